"""The 1-byte gap encode, vectorized per 65536-element block (a block with a gap of 255
or more is redone by a scalar loop with the escape): one 256 MiB bf16 bucket at 4.2 %,
best of 7. Prints bytes written, changes, ms, and the gaps of 255 or more.

    .venv/bin/python results/2026-11-24d-delta-cpu/gap8_encode_vector.py
"""

import time

import numba
import numpy as np


@numba.njit(cache=False, nogil=True, fastmath=False)
def diff8(lb, ob):
    # ob[j] = lb[j] - lb[j-1] - 1 (j >= 1); returns max difference
    mx = np.uint16(0)
    for j in range(1, lb.size):
        d = np.uint16(lb[j] - lb[j - 1])
        ob[j] = np.uint8(d - np.uint16(1))
        mx = max(mx, d)
    return mx


@numba.njit(cache=False, nogil=True)
def enc(counts, low, nblocks, out):
    at = 0
    i = 0
    prev = np.int64(-1)
    for b in range(nblocks):
        c = np.int64(counts[b])
        if c == 0:
            continue
        base = np.int64(b) << 16
        g0 = (base | np.int64(low[i])) - prev - 1
        mx = diff8(low[i : i + c], out[at : at + c])
        out[at] = np.uint8(g0 & 0xFF)
        if g0 >= 255 or mx >= 256:
            p_prev = prev
            for j in range(c):
                p = base | np.int64(low[i + j])
                gg = p - p_prev - 1
                p_prev = p
                if gg < 255:
                    out[at] = gg
                    at += 1
                else:
                    out[at] = 255
                    out[at + 1] = gg & 0xFF
                    out[at + 2] = (gg >> 8) & 0xFF
                    out[at + 3] = (gg >> 16) & 0xFF
                    out[at + 4] = (gg >> 24) & 0xFF
                    at += 5
        else:
            at += c
        prev = base | np.int64(low[i + c - 1])
        i += c
    return at


rng = np.random.default_rng(0)
n = 128 << 20
pos = np.flatnonzero(rng.random(n, dtype=np.float32) < 0.042)
k = pos.size
nb = -(-n // 65536)
counts = np.bincount(pos >> 16, minlength=nb).astype(np.uint32)
low = (pos & 0xFFFF).astype(np.uint16)
out = np.empty(5 * k + 16, np.uint8)
enc(counts, low, nb, out)
t = []
for _ in range(7):
    t0 = time.perf_counter()
    m = enc(counts, low, nb, out)
    t.append(time.perf_counter() - t0)
g = np.diff(np.concatenate([[-1], pos])) - 1
print(m, k, min(t) * 1e3, "ms", (g >= 255).sum())
