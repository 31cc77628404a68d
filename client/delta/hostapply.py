"""The engine's apply of one BLOCK16 payload into host memory, each range checksummed
while its bytes are in cache.

A payload's stream is its blocks (the sender's writes to this rank: region, offset,
length, count, stride) end to end. Its body is checked once (`decodeloop.block16_starts`:
counts add up, positions in range and increasing) before any byte is written. Then,
block by block and piece by piece (a piece: the part of a registered tensor a block
covers), in chunks of `CHUNK` bytes: the changes that fall in the chunk are written into
it (`decodeloop.scatter`, straight from the body's low 16 position bits: no int64
positions), and the chunk is fed to its range's xxh3 at once. Every byte of the range is
hashed, changed or not, in the range's order: the same checksum as hashing the range
after the apply, for one pass over memory instead of two.

A range is hashed here only when the caller asks (host memory, a range of the bucket or
version being checked) and when it is one block of this payload exactly once (a range
written twice is left to the caller, which checksums it after every payload). A piece
that is not aligned to the element width goes through `codec.scatter` instead. Given a
thread pool (the receiver's, at a version's end, when nothing else of the version is
left to overlap), the payload's blocks are applied on its threads at once.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from . import codec, decodeloop
from .frames import Range

CHUNK = 1 << 20  # bytes scattered and then hashed while in cache
THREADS = min(2, os.cpu_count() or 1)
PiecesOf = Callable[[int, int, int], list[torch.Tensor]]
_pool: ThreadPoolExecutor | None = None


def tail_pool() -> Executor | None:
    """The threads a version's last payloads are applied on (None: one core)."""
    global _pool
    if THREADS < 2:
        return None
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="delta-apply")
    return _pool


class _Body:
    """A checked BLOCK16 body: its parts, each block's first change, and the positions
    (int64) once a misaligned piece needs them."""

    def __init__(self, body: np.ndarray, n: int, k: int, width: int) -> None:
        self.width = width
        self.counts, self.low, self.vals = codec.block16_parts(body, n, k, width)
        self.starts = decodeloop.block16_starts(self.counts, self.low, n)  # before any write
        self._positions: torch.Tensor | None = None
        self._lock = threading.Lock()

    def positions(self) -> torch.Tensor:
        with self._lock:
            if self._positions is None:
                self._positions = torch.from_numpy(codec.block_positions(self.counts, self.low))
            return self._positions

    def block(self, r: Range, at: int, pieces_of: PiecesOf, hashed: bool) -> int | None:
        """Apply the changes of block `r`, at stream byte `at`; its xxh3-64 if `hashed`."""
        region, offset, length, count, stride = r
        w = self.width
        h = xxhash.xxh3_64() if hashed else None
        for i in range(count):
            for piece in pieces_of(region, offset + i * stride, length):
                raw = piece.numpy()
                size = raw.size
                if at % w or size % w or raw.ctypes.data % w:
                    _misaligned(piece, self.positions(), self.vals, at, w)
                    if h is not None:
                        h.update(raw.data)
                    at += size
                    continue
                el = raw.view(self.vals.dtype)
                for c in range(0, size, CHUNK):
                    stop = min(size, c + CHUNK)
                    lo, hi = c // w, stop // w
                    first = at // w
                    decodeloop.scatter(
                        el[lo:hi], self.starts, self.low, self.vals, first + lo, first + hi
                    )
                    if h is not None:
                        h.update(raw[c:stop].data)
                at += size
        return None if h is None else h.intdigest()


def block16(
    body: np.ndarray,
    n: int,
    k: int,
    width: int,
    blocks: tuple[Range, ...],
    pieces_of: PiecesOf,
    hashed: set[Range],
    pool: Executor | None = None,
) -> dict[Range, int]:
    """Apply a BLOCK16 body (uint8) of k changes of an n-element stream over `blocks`
    into the host pieces `pieces_of(region, offset, length)` gives; the xxh3-64 of each
    block in `hashed` (and in `blocks` once), as its bytes are after the apply. With a
    `pool`, distinct blocks are applied on its threads at once (numba's loop and xxh3
    both run without the GIL)."""
    checked = _Body(body, n, k, width)
    once = {r for r, c in Counter(blocks).items() if c == 1}
    jobs, at = [], 0
    for r in blocks:
        jobs.append((r, at, r in once and r in hashed))
        at += r[2] * r[3]

    def one(job: tuple[Range, int, bool]) -> int | None:
        return checked.block(job[0], job[1], pieces_of, job[2])

    parallel = pool is not None and len(blocks) > 1 and len(once) == len(blocks)
    got = list(pool.map(one, jobs)) if parallel and pool is not None else [one(j) for j in jobs]
    return {r: value for (r, _, _), value in zip(jobs, got, strict=True) if value is not None}


def _misaligned(
    out: torch.Tensor, positions: torch.Tensor, vals: np.ndarray, at: int, width: int
) -> None:
    """The changes in the stream bytes [at, at + out's size) into `out` (`codec.scatter`:
    byte by byte where the piece is not aligned)."""
    a = int(torch.searchsorted(positions, at // width))
    b = int(torch.searchsorted(positions, (at + out.numel()) // width))
    if b > a:
        local = positions[a:b] - at // width
        values = torch.from_numpy(vals[a:b].view(np.uint8).copy())
        codec.scatter(out, local, values, width)
