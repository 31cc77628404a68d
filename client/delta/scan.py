"""One pass over a host block: find its changed elements, move the shadow on, hash it.

The sender's CPU hot path. For each block of a bucket (new bytes in staging, the bytes
last sent in the shadow) `scan` reads both once, in chunks that stay in cache, and:

- finds the elements whose bytes differ, comparing 8-byte words first and only the
  words that differ element by element (bitwise: integers, never floats);
- writes only those words into the shadow (the stream is read once and written rarely);
- feeds the new bytes to the range's xxh3 while the chunk is in cache;
- stops collecting once the changes exceed `limit` (the bucket will go dense), copying
  the rest into the shadow.

With numba installed the compare is one compiled loop over words (no temporaries
proportional to the stream); without it, numpy in chunks (several times slower at a few
percent density: `np.flatnonzero` dominates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # optional: the compiled word loop (pip install numba)
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

CHUNK = 1 << 20  # bytes per step: both streams' chunks stay in L2 while hashed and compared
NP_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SAMPLE_BYTES = 4096
SAMPLES_PER_BLOCK = 16


@dataclass(frozen=True)
class Scanned:
    """Changes of one block: sorted element positions (int64, from the block's start) and
    their new values (the elements' bytes, in order); `compared` elements were compared."""

    pos: np.ndarray
    values: np.ndarray
    compared: int


def _words_py(a64: Any, b64: Any, a_el: Any, pos: Any, val: Any, k: int, limit: int, r: int) -> Any:
    """Compare words a64 with b64 (the shadow, updated where they differ); record
    (element position, value) of each differing element of `r` per word from `k` on
    (branch-free within a word: pos and val need `r` spare entries past `limit`).
    Returns (k, words done): it stops after the word that takes k past `limit`."""
    bits = np.uint64(64 // r)
    mask = np.uint64((1 << (64 // r)) - 1) if r > 1 else np.uint64(0xFFFFFFFFFFFFFFFF)
    n = a64.size
    for j in range(n):
        x = a64[j] ^ b64[j]
        if x != 0:
            b64[j] = a64[j]
            for e in range(r):
                pos[k] = j * r + e
                val[k] = a_el[j * r + e]
                k += ((x >> (bits * np.uint64(e))) & mask) != 0
            if k > limit:
                return k, j + 1
    return k, n


_words = numba.njit(cache=True, nogil=True)(_words_py) if numba is not None else None


def compiled() -> bool:
    return _words is not None


def warm() -> None:
    """Compile (or load from numba's cache) the word loop before it is timed."""
    if _words is None:
        return
    for dt in NP_INT.values():
        a = np.zeros(8, dtype=np.uint8)
        el = a.view(dt)
        _words(a.view(np.uint64), a.copy().view(np.uint64), el, np.zeros(1, np.int64),
               np.zeros(1, dt), 0, 0, 8 // el.itemsize)  # fmt: skip


def aligned(new: np.ndarray, old: np.ndarray, width: int) -> bool:
    return new.ctypes.data % width == 0 and old.ctypes.data % width == 0


def scan(
    new: np.ndarray, old: np.ndarray, width: int, limit: int, hasher: Any | None
) -> Scanned | None:
    """Block `new` (uint8) against `old` (the shadow: left equal to `new`), hashing `new`
    into `hasher`; None when more than `limit` elements changed (the shadow is moved on
    and the hash fed all the same). Both must be aligned to `width`."""
    n_el = new.size // width
    room = min(limit, n_el) + 9  # r spare entries past the limit (see _words_py)
    pos = np.empty(room, dtype=np.int64)
    val = np.empty(room, dtype=NP_INT[width])
    k = 0
    at = 0
    size = new.size
    bail = False
    while at < size:
        end = min(size, at + CHUNK)
        a, b = new[at:end], old[at:end]
        if not bail:
            k, done = _scan_chunk(a, b, width, pos, val, k, limit, at // width)
            if k > limit:
                bail = True
                np.copyto(b[done:], a[done:])
        else:
            np.copyto(b, a)
        if hasher is not None:
            hasher.update(a)
        at = end
    if bail:
        return None
    return Scanned(pos[:k], val[:k].view(np.uint8), n_el)


def _scan_chunk(
    a: np.ndarray,
    b: np.ndarray,
    width: int,
    pos: np.ndarray,
    val: np.ndarray,
    k: int,
    limit: int,
    base: int,
) -> tuple[int, int]:
    """Changes of chunk a against b (updated), positions from `base`; (k, bytes done)."""
    k0 = k
    whole = a.size - a.size % 8
    if _words is not None and whole and a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0:
        r = 8 // width
        k, words = _words(
            a[:whole].view(np.uint64), b[:whole].view(np.uint64),
            a[:whole].view(NP_INT[width]), pos, val, k, limit, r,
        )  # fmt: skip
        pos[k0 : min(k, limit)] += base
        if k > limit:
            return k, words * 8
        if whole == a.size:
            return k, a.size
        k0 = k
        tail_a, tail_b, tail_at = a[whole:], b[whole:], whole
    else:
        tail_a, tail_b, tail_at = a, b, 0
    ea, eb = tail_a.view(NP_INT[width]), tail_b.view(NP_INT[width])
    hit = np.flatnonzero(ea != eb)
    take = min(hit.size, max(0, limit - k))
    pos[k : k + take] = hit[:take] + (base + tail_at // width)
    val[k : k + take] = ea[hit[:take]]
    eb[hit] = ea[hit]
    return k + hit.size, a.size


def copy(new: np.ndarray, old: np.ndarray, hasher: Any | None) -> None:
    """The shadow takes a block whole (no compare), hashed on the way."""
    if hasher is None:
        np.copyto(old, new)
        return
    for at in range(0, new.size, CHUNK):
        a = new[at : at + CHUNK]
        np.copyto(old[at : at + CHUNK], a)
        hasher.update(a)


def sample(new: np.ndarray, old: np.ndarray, width: int) -> tuple[int, int]:
    """(changed, compared) elements in up to SAMPLES_PER_BLOCK windows spread over a block
    (the whole of a small one): a cheap density estimate before the full compare."""
    size = new.size - new.size % width
    if size <= SAMPLE_BYTES * SAMPLES_PER_BLOCK:
        a, b = new[:size].view(NP_INT[width]), old[:size].view(NP_INT[width])
        return int(np.count_nonzero(a != b)), a.size
    stride = (size // SAMPLES_PER_BLOCK) // width * width
    changed = compared = 0
    for i in range(SAMPLES_PER_BLOCK):
        at = i * stride
        a = new[at : at + SAMPLE_BYTES].view(NP_INT[width])
        b = old[at : at + SAMPLE_BYTES].view(NP_INT[width])
        changed += int(np.count_nonzero(a != b))
        compared += a.size
    return changed, compared
