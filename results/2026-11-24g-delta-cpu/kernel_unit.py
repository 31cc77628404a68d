"""The sender's compare loop alone (`scankernel.run`) over 1 GiB of 2-byte elements with 4.1 %
of them changed in their low bit, compared as elements (width 2) and as bytes (width 1),
three rounds each, in 1 MiB runs as the host pass does: seconds and changes found.

    .venv/bin/python results/2026-11-24g-delta-cpu/kernel_unit.py
"""

import numpy as np, time
from weightwire.client.delta import scankernel as sk
n = 1 << 29  # elements of bf16 = 1 GiB
rng = np.random.default_rng(0)
a = rng.integers(0, 1<<16, n, dtype=np.uint16)
b = a.copy()
idx = rng.random(n) < 0.041
a2 = a.copy(); a2[idx] ^= 1
blk = 1 << 20  # elements per run (as the host pass chunks? approx)
def go(width):
    A = a2.view(np.uint8) if width == 1 else a2
    B = b.copy(); B = B.view(np.uint8) if width == 1 else B
    m = A.size
    per = (1 << 20) // width  # 1 MiB of bytes per run
    low = np.zeros(per + sk.SPARE, np.uint16); val = np.zeros(per + sk.SPARE, A.dtype)
    counts = np.zeros((m >> 16) + 2, np.uint32)
    t = time.perf_counter(); tot = 0
    for s in range(0, m, per):
        k, done = sk.run(A[s:s+per], B[s:s+per], low, val, counts, 0, per, s)
        tot += k
    return time.perf_counter() - t, tot
sk.warm()
for r in range(3):
    for w in (2, 1):
        dt, k = go(w)
        print(w, round(dt, 4), k)
