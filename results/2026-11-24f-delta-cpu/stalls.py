"""The sender's compare loop alone, 150 times in a row on the same 1 GiB (bf16, 4.1 % of
elements changed, hashed as a version hashes it): no daemon, no engine, no torch. Prints
each pass slower than 0.1 s with its time since the start, then the spread.

    .venv/bin/python results/2026-11-24f-delta-cpu/stalls.py [small|huge]

`huge`: the four buffers are anonymous maps advised MADV_HUGEPAGE (this VM's THP setting is
`madvise`); `small` (default): 4 KiB pages, as numpy allocates them.
"""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np
import xxhash

from weightwire.client.delta import scan

N = 1 << 29  # elements (1 GiB of bf16)
HUGE = len(sys.argv) > 1 and sys.argv[1] == "huge"


def buf(nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if HUGE:
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)


def main() -> None:
    rng = np.random.default_rng(0)
    old = buf(2 * N).view(np.uint16)
    old[:] = rng.integers(0, 1 << 16, N, dtype=np.uint16)
    new = buf(2 * N).view(np.uint16)
    new[:] = old
    new[np.flatnonzero(rng.random(N, dtype=np.float32) < 0.041)] ^= 1
    back = buf(2 * N)
    back[:] = old.view(np.uint8)
    versions = [new.view(np.uint8), back]  # the shadow alternates between the two
    shadow = buf(2 * N)
    shadow[:] = old.view(np.uint8)
    scan.warm()
    out = []
    t0 = time.time()
    for i in range(150):
        acc = scan.Changes(N, 2, N // 10)
        t = time.perf_counter()
        scan.scan(versions[i % 2], shadow, acc, 0, xxhash.xxh3_64())
        out.append(time.perf_counter() - t)
        if out[-1] > 0.1:
            print(f"{time.time() - t0:6.2f} s: {out[-1]:.3f} s", flush=True)
    s = sorted(out)
    print(
        f"{'huge' if HUGE else 'small'} pages: median {s[75]:.4f} s, p10 {s[15]:.4f}, "
        f"p90 {s[135]:.4f}, max {s[-1]:.4f}, passes over 0.1 s: {sum(x > 0.1 for x in out)}"
    )


if __name__ == "__main__":
    main()
