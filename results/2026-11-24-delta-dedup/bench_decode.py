"""BLOCK16 decode on the CPU: numpy and the compiled loop in one process, checked equal."""

import time

import numpy as np

from weightwire.client.delta import codec, decodeloop

print("numba", decodeloop._block16 is not None)
decodeloop.warm()
n = 128 << 20  # bf16 elements: 256 MiB
rng = np.random.default_rng(0)
pos = np.sort(rng.choice(n, int(0.042 * n), replace=False)).astype(np.int64)
k = pos.size
nb = -(-n // codec.BLOCK)
counts = np.bincount(pos >> 16, minlength=nb).astype(np.uint32)
low = (pos & 0xFFFF).astype(np.uint16)
body = np.concatenate([counts.view(np.uint8), low.view(np.uint8), np.zeros(2 * k, np.uint8)])


def decode() -> np.ndarray:
    return codec._decode_head_np(codec.Kind.BLOCK16, body, n, k)[0]


def best(r: int = 5) -> float:
    ts = []
    for _ in range(r):
        t = time.perf_counter()
        decode()
        ts.append(time.perf_counter() - t)
    return min(ts)


saved = decodeloop._block16
p1, t_fast = decode(), best()
decodeloop._block16 = None
p0, t_np = decode(), best()
decodeloop._block16 = saved
assert np.array_equal(p0, p1) and np.array_equal(p0, pos)
gib = 2 * n / (1 << 30)
print(
    f"BLOCK16 decode of {gib:.2f} GiB at 4.2 %: numpy {t_np / gib:.4f} s/GiB, "
    f"numba {t_fast / gib:.4f} s/GiB, ratio {t_np / t_fast:.2f}x"
)
