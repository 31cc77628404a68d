"""The engine's BLOCK16 decode on the CPU as compiled loops (numba, when installed).

- `block16_positions`: positions rebuilt from the per-block counts and low 16 bits and
  checked (in range, strictly increasing) in the same pass, without numpy's temporaries
  (repeat, shift, or, then a comparison of two shifted copies).
- `block16_starts` + `scatter`: no positions at all. The body is checked once (the same
  checks) into each block's first change; then the changes that fall in a range of the
  stream are written straight into the destination's elements there, a piece at a time
  (so the receiver can checksum each piece while it is in cache).
"""

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


def _starts_py(counts: np.ndarray, low: np.ndarray, n: int, starts: np.ndarray) -> int:
    """starts[b] := the index of block b's first change (counts.size + 1 entries).
    Returns 0, or 1 when the counts do not add up to k, 2 when a position is out of
    range or not increasing (as `_block16_py`)."""
    k = low.size
    i = 0
    for b in range(counts.size):
        starts[b] = i
        c = int(counts[b])
        if c > k - i:
            return 1
        if c:
            run = low[i : i + c]
            bad = False
            for j in range(1, c):  # no branch on the data: vectorized
                bad |= run[j] <= run[j - 1]
            if bad or (np.int64(b) << 16) + np.int64(run[c - 1]) >= n:
                return 2
        i += c
    starts[counts.size] = i
    return 0 if i == k else 1


def _scatter_py(
    out: np.ndarray, starts: np.ndarray, low: np.ndarray, vals: np.ndarray, s: int, e: int
) -> int:
    """out[p - s] := vals[i] for each change i at position p with s <= p < e (out: the
    e - s elements there). Returns how many it wrote."""
    if e <= s:
        return 0
    first, last = s >> 16, (e - 1) >> 16
    done = 0
    for b in range(first, last + 1):
        lo, hi = starts[b], starts[b + 1]
        base = (np.int64(b) << 16) - s
        if b == first:
            lo += np.searchsorted(low[lo:hi], s & 0xFFFF)
        if b == last:
            hi = starts[b] + np.searchsorted(low[starts[b] : hi], ((e - 1) & 0xFFFF) + 1)
        for i in range(lo, hi):
            out[base + np.int64(low[i])] = vals[i]
        done += max(0, hi - lo)
    return done


if numba is not None:
    _block16 = numba.njit(cache=True, nogil=True)(_block16_py)
    _starts = numba.njit(cache=True, nogil=True)(_starts_py)
    _scatter = numba.njit(cache=True, nogil=True)(_scatter_py)
else:  # pragma: no cover - exercised where numba is absent
    _block16 = _starts = _scatter = None


def compiled() -> bool:
    return _scatter is not None


def block16_starts(counts: np.ndarray, low: np.ndarray, n: int) -> np.ndarray:
    """Each block's first change (int64, one more entry: k) of a BLOCK16 body of an
    n-element stream, checked; raises ValueError as `block16_positions` does (compiled
    only: without numba the receiver decodes positions)."""
    if n < 0 or counts.size != -(-n // (1 << 16)):
        raise ValueError(f"{counts.size} BLOCK16 counts for {n} elements")
    assert _starts is not None, "numba is not installed: decode with block16_positions"
    starts = np.empty(counts.size + 1, dtype=np.int64)
    _check(_starts(counts, low, n, starts))
    return starts


def scatter(
    out: np.ndarray, starts: np.ndarray, low: np.ndarray, vals: np.ndarray, s: int, e: int
) -> int:
    """The changes at positions [s, e) of a checked body (`block16_starts`) into `out`
    (those e - s elements, same dtype as vals); how many."""
    if out.size != e - s or s < 0 or out.dtype != vals.dtype:
        raise ValueError(f"{out.size} {out.dtype} elements for [{s}, {e}) of {vals.dtype}")
    if e > s and (e - 1) >> 16 >= starts.size - 1:
        raise ValueError(f"positions up to {e} past the body's {starts.size - 1} blocks")
    assert _scatter is not None, "numba is not installed: use codec.scatter"
    return int(_scatter(out, starts, low, vals, s, e))


def block16_positions(counts: np.ndarray, low: np.ndarray, n: int) -> np.ndarray | None:
    """The sorted positions of a BLOCK16 body, checked; None without numba (use numpy).
    Raises ValueError as the numpy path does."""
    if _block16 is None:
        return None
    pos = np.empty(low.size, dtype=np.int64)
    _check(_block16(counts, low, n, pos))
    return pos


def _check(code: int) -> None:
    """Raise what a compiled decode's return code says (as the numpy decode does)."""
    match code:
        case 1:
            raise ValueError("BLOCK16 counts do not add up to the changes")
        case 2:
            raise ValueError("delta positions are out of range or not increasing")


def warm() -> None:
    """Compile (or load from numba's cache) before anything is timed: the decode, and
    the apply for every width, values aligned or not (a BLOCK16 body's values follow
    2-byte positions)."""
    block16_positions(np.zeros(1, np.uint32), np.zeros(0, np.uint16), 1)
    if _scatter is None:
        return
    starts = block16_starts(np.zeros(1, np.uint32), np.zeros(0, np.uint16), 1)
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        out = np.zeros(1, dt)
        raw = np.zeros(2 * out.itemsize, np.uint8)
        for vals in (raw[: out.itemsize].view(dt), raw[1 : 1 + out.itemsize].view(dt)):
            scatter(out, starts, np.zeros(0, np.uint16), vals, 0, 1)
