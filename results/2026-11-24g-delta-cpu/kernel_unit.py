"""The sender's compare loop alone (`scankernel.run`) over 1 GiB of 2-byte elements with 4.1 %
of them changed in their low bit, compared as elements (width 2) and as bytes (width 1),
three rounds each, in 1 MiB runs as the host pass does: seconds and changes found.

    .venv/bin/python results/2026-11-24g-delta-cpu/kernel_unit.py
"""

from __future__ import annotations

import time

import numpy as np

from weightwire.client.delta import scankernel

ELEMENTS = 1 << 29  # 2-byte elements: 1 GiB
RUN_BYTES = 1 << 20


def streams() -> tuple[np.ndarray, np.ndarray]:
    """The new elements and the shadow (4.1 % of them differ in their low bit)."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, ELEMENTS, dtype=np.uint16)
    new = old.copy()
    new[rng.random(ELEMENTS) < 0.041] ^= 1
    return new, old


def compare(new: np.ndarray, old: np.ndarray, width: int) -> tuple[float, int]:
    """Seconds and changes of one pass in units of `width` bytes (a fresh shadow)."""
    a = new.view(np.uint8) if width == 1 else new
    b = old.copy()
    b = b.view(np.uint8) if width == 1 else b
    per = RUN_BYTES // width
    low = np.zeros(per + scankernel.SPARE, np.uint16)
    val = np.zeros(per + scankernel.SPARE, a.dtype)
    counts = np.zeros((a.size >> 16) + 2, np.uint32)
    t0, found = time.perf_counter(), 0
    for s in range(0, a.size, per):
        k, _ = scankernel.run(a[s : s + per], b[s : s + per], low, val, counts, 0, per, s)
        found += k
    return time.perf_counter() - t0, found


def main() -> None:
    scankernel.warm()
    new, old = streams()
    for _ in range(3):
        for width in (2, 1):
            seconds, found = compare(new, old, width)
            print(f"width {width}: {seconds:.4f} s, {found} changes", flush=True)


if __name__ == "__main__":
    main()
