import time, numpy as np, torch
from weightwire.client.delta import codec, decodeloop
print("numba", decodeloop._block16 is not None)
decodeloop.warm()
n = 128 << 20  # bf16 elements: 256 MiB
rng = np.random.default_rng(0)
pos = np.sort(rng.choice(n, int(0.042 * n), replace=False)).astype(np.int64)
k = pos.size
nb = -(-n // codec.BLOCK)
counts = np.bincount(pos >> 16, minlength=nb).astype(np.uint32)
body = np.concatenate([counts.view(np.uint8), (pos & 0xFFFF).astype(np.uint16).view(np.uint8), np.zeros(2 * k, np.uint8)])
def best(f, r=5):
    ts = []
    for _ in range(r):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)
fast = lambda: codec._decode_head_np(codec.Kind.BLOCK16, body, n, k)
saved = decodeloop._block16
p1, _ = fast()
t_fast = best(fast)
decodeloop._block16 = None
p0, _ = codec._decode_head_np(codec.Kind.BLOCK16, body, n, k)
t_np = best(fast)
decodeloop._block16 = saved
assert np.array_equal(p0, p1) and np.array_equal(p0, pos)
gib = 2 * n / (1 << 30)
print(f"BLOCK16 decode of {gib:.2f} GiB at 4.2 %: numpy {t_np/gib:.4f} s/GiB, numba {t_fast/gib:.4f} s/GiB, ratio {t_np/t_fast:.2f}x")
