"""The engine's BLOCK16 decode on the CPU as one compiled loop (numba, when installed):
positions rebuilt from the per-block counts and low 16 bits and checked (in range,
strictly increasing) in the same pass, without numpy's temporaries (repeat, shift, or,
then a comparison of two shifted copies)."""

from __future__ import annotations

import numpy as np

try:  # optional, as in `scan`
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]


def _block16_py(counts: np.ndarray, low: np.ndarray, n: int, pos: np.ndarray) -> int:
    """Fill pos (k entries) from BLOCK16 counts (uint32) and low bits (uint16). Returns
    0, or 1 when the counts do not add up to k, 2 when a position is out of range or not
    increasing."""
    k = pos.size
    i = 0
    last = np.int64(-1)
    for b in range(counts.size):
        c = np.int64(counts[b])
        if c > k - i:
            return 1
        base = np.int64(b) << 16
        for _ in range(c):
            p = base | np.int64(low[i])
            if p <= last or p >= n:
                return 2
            pos[i] = p
            last = p
            i += 1
    return 0 if i == k else 1


_block16 = numba.njit(cache=True, nogil=True)(_block16_py) if numba is not None else None


def block16_positions(counts: np.ndarray, low: np.ndarray, n: int) -> np.ndarray | None:
    """The sorted positions of a BLOCK16 body, checked; None without numba (use numpy).
    Raises ValueError as the numpy path does."""
    if _block16 is None:
        return None
    pos = np.empty(low.size, dtype=np.int64)
    match _block16(counts, low, n, pos):
        case 1:
            raise ValueError("BLOCK16 counts do not add up to the changes")
        case 2:
            raise ValueError("delta positions are out of range or not increasing")
    return pos


def warm() -> None:
    """Compile (or load from numba's cache) before anything is timed."""
    block16_positions(np.zeros(1, np.uint32), np.zeros(0, np.uint16), 1)
