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

import threading
from typing import Any

import numpy as np

try:  # optional: the compiled word loop (pip install numba)
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]

CHUNK = 1 << 20  # bytes per step: both streams' chunks stay in L2 while hashed and compared
NP_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
PROJECT_MARGIN = 1.25  # a block whose first eighth or more projects this far past the limit
SAMPLE_BYTES = 4096
SAMPLES_PER_BLOCK = 16
_local = threading.local()


class Changes:
    """Changes found so far for one payload (across its blocks): element positions in its
    stream (sorted, int64) and their new values, with room for `limit` of them (and the
    spare entries the word loop writes past it)."""

    def __init__(self, elements: int, width: int, limit: int) -> None:
        room = max(0, min(limit, elements)) + 9
        self.width, self.limit, self.k = width, limit, 0
        self.pos = np.empty(room, dtype=np.int64)
        self.val = np.empty(room, dtype=NP_INT[width])

    @property
    def positions(self) -> np.ndarray:
        return self.pos[: self.k]

    @property
    def values(self) -> np.ndarray:
        """The changed elements' bytes, in order (uint8)."""
        return self.val[: self.k].view(np.uint8)


def _words_py(
    a64: Any,
    b64: Any,
    a_el: Any,
    pos: Any,
    val: Any,
    k: int,
    limit: int,
    r: int,
    base: int,
    scratch: Any,
) -> Any:
    """Compare words a64 with b64 (the shadow, updated where they differ); record
    (base + element position, value) of each differing element of `r` per word from `k` on
    (branch-free within a word: pos and val need `r` spare entries past `limit`).
    Returns (k, words done): it stops after the word that takes k past `limit`.

    Two passes: the indices of the differing words into `scratch` (>= len(a64) + 1
    entries) without a branch (a streaming read, at memory speed), then only those words.
    One branch per word mispredicts at a few percent density (16 % of bf16 words differ at
    4 % of elements): 1.6x slower on the development VM."""
    bits = np.uint64(64 // r)
    mask = np.uint64((1 << (64 // r)) - 1) if r > 1 else np.uint64(0xFFFFFFFFFFFFFFFF)
    n = a64.size
    m = 0
    for j in range(n):
        scratch[m] = j
        m += a64[j] != b64[j]
    for i in range(m):
        j = scratch[i]
        aj = a64[j]
        x = aj ^ b64[j]
        b64[j] = aj
        for e in range(r):
            pos[k] = base + j * r + e
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
               np.zeros(1, dt), 0, 0, 8 // el.itemsize, 0, _scratch())  # fmt: skip


def _scratch(words: int = 0) -> np.ndarray:
    """This thread's word indices for `_words` (at least a chunk's worth, kept)."""
    buf: np.ndarray | None = getattr(_local, "scratch", None)
    if buf is None or buf.size <= words:
        buf = _local.scratch = np.empty(max(words, CHUNK // 8) + 1, dtype=np.int64)
    return buf


def aligned(new: np.ndarray, old: np.ndarray, width: int) -> bool:
    return new.ctypes.data % width == 0 and old.ctypes.data % width == 0


def scan(new: np.ndarray, old: np.ndarray, acc: Changes, base: int, hasher: Any) -> bool:
    """Block `new` (uint8) against `old` (the shadow: left equal to `new`), hashing `new`
    into `hasher` (an xxh3, a list of them, or None), its changes added to `acc` at
    element `base` of the payload's stream.
    False when the payload cannot fit: more than `acc.limit` changes, or a block whose
    first part projects well past it (the shadow is moved on and the hash fed all the
    same). Both must be aligned to the width."""
    width = acc.width
    size = new.size
    k0 = acc.k
    at = 0
    bail = False
    while at < size:
        end = min(size, at + CHUNK)
        a, b = new[at:end], old[at:end]
        if not bail:
            done = _scan_chunk(a, b, acc, base + at // width)
            at_done = at + done
            spent = acc.k - k0
            bail = acc.k > acc.limit or (
                size // 8 <= at_done < size
                and spent * size > PROJECT_MARGIN * at_done * max(0, acc.limit - k0)
            )
            if bail:
                np.copyto(b[done:], a[done:])
        else:
            np.copyto(b, a)
        feed(hasher, a)
        at = end
    return not bail


def feed(hasher: Any, data: np.ndarray) -> None:
    if hasher is None:
        return
    if isinstance(hasher, list | tuple):
        for h in hasher:
            h.update(data)
    else:
        hasher.update(data)


def _scan_chunk(a: np.ndarray, b: np.ndarray, acc: Changes, base: int) -> int:
    """Changes of chunk a against b (updated) into `acc`, positions from `base`; the bytes
    done (all, unless it stopped past the limit)."""
    width, limit = acc.width, acc.limit
    whole = a.size - a.size % 8
    if _words is not None and whole and a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0:
        r = 8 // width
        acc.k, words = _words(
            a[:whole].view(np.uint64), b[:whole].view(np.uint64),
            a[:whole].view(NP_INT[width]), acc.pos, acc.val, acc.k, limit, r, base,
            _scratch(whole // 8),
        )  # fmt: skip
        if acc.k > limit:
            return int(words) * 8
        if whole == a.size:
            return a.size
        tail_a, tail_b, tail_at = a[whole:], b[whole:], whole
    else:
        tail_a, tail_b, tail_at = a, b, 0
    ea, eb = tail_a.view(NP_INT[width]), tail_b.view(NP_INT[width])
    hit = np.flatnonzero(ea != eb)
    k = acc.k
    take = min(hit.size, max(0, limit - k))
    acc.pos[k : k + take] = hit[:take] + (base + tail_at // width)
    acc.val[k : k + take] = ea[hit[:take]]
    eb[hit] = ea[hit]
    acc.k = k + hit.size
    return a.size


def copy(new: np.ndarray, old: np.ndarray, hasher: Any) -> None:
    """The shadow takes a block whole (no compare), hashed on the way (`hasher`: an xxh3,
    a list of them, or None)."""
    if hasher is None or (isinstance(hasher, list | tuple) and not hasher):
        np.copyto(old, new)
        return
    for at in range(0, new.size, CHUNK):
        a = new[at : at + CHUNK]
        np.copyto(old[at : at + CHUNK], a)
        feed(hasher, a)


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
