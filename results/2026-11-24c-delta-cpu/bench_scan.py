"""The sender's compare alone: 256 MiB of bf16 against a shadow differing in 4.2 % of its
elements, through `scan.scan` (compare, shadow moved on, changes kept, and with xxh3 fed
chunk by chunk), by the compiled loop's vector step, its scalar step, and numpy, in one
process; then the memory floors of this machine. Best of 3, GB/s of new bytes.

    .venv/bin/python results/2026-11-24c-delta-cpu/bench_scan.py
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

from weightwire.client.delta import scan, scankernel

N = 256 << 20
rng = np.random.default_rng(0)
new = rng.integers(0, 256, N, dtype=np.uint8)
old = new.copy()
hit = rng.random(N // 2) < 0.042
old.view(np.uint16)[hit] ^= 1
want = int(hit.sum())
scan.warm()


def best(fn, reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        shadow = old.copy()
        t = time.perf_counter()
        fn(shadow)
        times.append(time.perf_counter() - t)
        assert np.array_equal(shadow, new)
    return N / min(times) / 1e9


def run(path: str, hashed: bool) -> float:
    kernel, simd = scan._kernel, scankernel.SIMD
    if path == "numpy":
        scan._kernel = None
    else:
        scankernel.SIMD = path == "vector"
    acc = scan.Changes(N // 2, 2, N // 2)  # reused: paged in by the first repetition

    def one(shadow: np.ndarray) -> None:
        acc.k, acc.counts[:] = 0, 0
        assert scan.scan(new, shadow, acc, 0, xxhash.xxh3_64() if hashed else None)
        assert acc.k == want

    try:
        return best(one)
    finally:
        scan._kernel, scankernel.SIMD = kernel, simd


paths = ["vector", "scalar", "numpy"] if scankernel.simd_available() else ["scalar", "numpy"]
for p in paths:
    print(f"scan {p:6s}: {run(p, False):5.2f} GB/s, with xxh3 {run(p, True):5.2f} GB/s")
print(f"floor, np.copyto (read + write): {best(lambda s: np.copyto(s, new)):5.2f} GB/s")
h = xxhash.xxh3_64()
t = time.perf_counter()
for at in range(0, N, 1 << 20):
    h.update(new[at : at + (1 << 20)])
print(f"floor, xxh3 from memory: {N / (time.perf_counter() - t) / 1e9:5.2f} GB/s")
