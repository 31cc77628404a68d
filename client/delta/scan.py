"""One pass over a host block: find its changed elements, move the shadow on, hash it.

The sender's CPU hot path. For each block of a bucket (new bytes in staging, the bytes
last sent in the shadow) `scan` reads both once, in chunks that stay in cache, and:

- finds the elements whose bytes differ (bitwise: integers, never floats) and keeps them
  in the form a BLOCK16 body sends (`Changes`: per 65536-element block of the payload's
  stream a count, each change's low 16 position bits, its value);
- leaves the shadow equal to the new bytes;
- feeds the new bytes to the range's xxh3 while the chunk is in cache;
- stops collecting once the changes exceed `limit` (the bucket will go dense), copying
  the rest into the shadow.

With numba installed the compare is one compiled loop (`scankernel`: vector compress
where the CPU has it); without it, numpy in chunks (several times slower at a few
percent density: `np.flatnonzero` dominates).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import scankernel
from .codec import BLOCK, block_positions

CHUNK = 1 << 20  # bytes per step: both streams' chunks stay in L2 while hashed and compared
NP_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
PROJECT_MARGIN = 1.25  # a block whose first eighth or more projects this far past the limit
SAMPLE_BYTES = 4096
SAMPLES_PER_BLOCK = 16
_kernel = scankernel.run if scankernel.compiled() else None


class Buffers(NamedTuple):
    """The position and value buffers of a `Changes` (values as bytes), to reuse."""

    low: np.ndarray
    val: np.ndarray


class Changes:
    """Changes found so far for one payload (across its blocks), sorted by position, in
    BLOCK16 form: `counts` per block of BLOCK elements of the stream (`blocks` of them),
    each change's low 16 position bits (`low`) and value (`val`); room for `limit` of
    them (of at most `elements`) and the spare entries the compare loop writes past it.
    `k` past `limit` means they did not fit (what is kept then is not all of them).
    Where the stream is 2-byte elements, `pairs[0]` counts those whose both bytes changed:
    compared as bytes, k - pairs[0] elements changed; as elements, k + pairs[0] bytes."""

    def __init__(
        self,
        elements: int,
        width: int,
        limit: int,
        blocks: int | None = None,
        spare: Buffers | None = None,
    ) -> None:
        """`spare`: buffers to reuse (`buffers()` of an earlier one) where they are large
        enough (fresh memory costs a page fault per page the loop first writes)."""
        room = max(0, min(limit, elements)) + scankernel.SPARE
        self.width, self.limit, self.k = width, limit, 0
        self.pairs = np.zeros(1, np.int64)  # 2-byte elements changed in both bytes
        nblocks = -(-elements // BLOCK) if blocks is None else blocks
        self.counts = np.zeros(max(1, nblocks), dtype=np.uint32)
        if spare is not None and spare.low.size >= room and spare.val.nbytes >= room * width:
            self.low = spare.low
            self.val = spare.val[: spare.val.nbytes // width * width].view(NP_INT[width])
        else:
            self.low = np.empty(room, dtype=np.uint16)
            self.val = np.empty(room, dtype=NP_INT[width])

    def buffers(self) -> Buffers:
        """Its buffers, for another one to reuse once this one is done with."""
        return Buffers(self.low, self.val.view(np.uint8))

    @property
    def room(self) -> int:
        return min(self.low.size, self.val.size) - scankernel.SPARE

    @property
    def positions(self) -> np.ndarray:
        """Their positions in the stream (int64, rebuilt from counts and low bits)."""
        return block_positions(self.counts, self.low[: self.k])

    @property
    def values(self) -> np.ndarray:
        """The changed elements' bytes, in order (uint8)."""
        return self.val[: self.k].view(np.uint8)

    def append(self, pos: np.ndarray, val: np.ndarray) -> None:
        """Changes at sorted positions `pos` (int64, after every one held), values `val`
        (elements of the width)."""
        k, m = self.k, pos.size
        if not m:
            return
        if k + m > self.room or int(pos[-1]) >> 16 >= self.counts.size or int(pos[0]) < 0:
            raise ValueError(f"{m} changes up to {int(pos[-1])} do not fit")
        np.copyto(self.low[k : k + m], pos, casting="unsafe")  # keeps the low 16 bits
        self.val[k : k + m] = val
        self.counts += np.bincount(pos >> 16, minlength=self.counts.size).astype(np.uint32)
        self.k = k + m

    def extend(self, other: Changes, shift: int) -> None:
        """`other`'s changes (after every one held), their positions moved by `shift`."""
        self.pairs += other.pairs
        if shift % BLOCK or other.counts.size + shift // BLOCK > self.counts.size:
            self.append(other.positions + shift, other.val[: other.k])
            return
        k, m = self.k, other.k
        if k + m > self.room:
            raise ValueError(f"{m} more changes do not fit")
        at = shift // BLOCK
        self.counts[at : at + other.counts.size] += other.counts
        self.low[k : k + m] = other.low[:m]
        self.val[k : k + m] = other.val[:m]
        self.k = k + m


def two_byte_counts(k: int, pairs: int, unit: int) -> tuple[int, int]:
    """(elements, bytes) changed of a stream of 2-byte elements, from a compare in units of
    `unit` bytes that found `k` changes, `pairs` of the elements changed in both bytes
    (`Changes.pairs`)."""
    return (k - pairs, k) if unit == 1 else (k, k + pairs)


def compiled() -> bool:
    return _kernel is not None


def warm() -> None:
    """Compile (or load from numba's cache) the compare loop before it is timed."""
    scankernel.warm()


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
    ea, eb = a.view(NP_INT[width]), b.view(NP_INT[width])
    if _kernel is not None:
        acc.k, done = _kernel(
            ea, eb, acc.low, acc.val, acc.counts, acc.k, limit, base, pairs=acc.pairs
        )
        return done * width
    hit = np.flatnonzero(ea != eb)
    if width == 1 and hit.size > 1:
        acc.pairs += np.count_nonzero((np.diff(hit) == 1) & ((hit[1:] + base) % 2 == 1))
    elif width == 2:
        d = ea[hit] ^ eb[hit]
        acc.pairs += np.count_nonzero((d & 0xFF != 0) & (d >> 8 != 0))
    if acc.k + hit.size > limit:
        acc.k += hit.size  # past the limit: the caller sees it go dense
    else:
        acc.append(hit + base, ea[hit])
    eb[hit] = ea[hit]
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
