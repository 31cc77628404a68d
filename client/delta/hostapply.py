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
that is not aligned to the element width goes through `codec.scatter` instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from . import codec, decodeloop
from .frames import Range

CHUNK = 1 << 20  # bytes scattered and then hashed while in cache
PiecesOf = Callable[[int, int, int], list[torch.Tensor]]


def block16(
    body: np.ndarray,
    n: int,
    k: int,
    width: int,
    blocks: tuple[Range, ...],
    pieces_of: PiecesOf,
    hashed: set[Range],
) -> dict[Range, int]:
    """Apply a BLOCK16 body (uint8) of k changes of an n-element stream over `blocks`
    into the host pieces `pieces_of(region, offset, length)` gives; the xxh3-64 of each
    block in `hashed` (and in `blocks` once), as its bytes are after the apply."""
    counts, low, vals = codec.block16_parts(body, n, k, width)
    starts = decodeloop.block16_starts(counts, low, n)  # checked before any write
    once = {r for r, c in Counter(blocks).items() if c == 1} & hashed
    sums: dict[Range, int] = {}
    positions: torch.Tensor | None = None  # int64, only for a misaligned piece
    at = 0  # stream byte of the current piece
    for r in blocks:
        region, offset, length, count, stride = r
        h = xxhash.xxh3_64() if r in once else None
        for i in range(count):
            for piece in pieces_of(region, offset + i * stride, length):
                raw = piece.numpy()
                size = raw.size
                if at % width or size % width or raw.ctypes.data % width:
                    if positions is None:
                        positions = torch.from_numpy(codec.block_positions(counts, low))
                    _misaligned(piece, positions, vals, at, width)
                    if h is not None:
                        h.update(raw.data)
                else:
                    el = raw.view(vals.dtype)
                    for c in range(0, size, CHUNK):
                        stop = min(size, c + CHUNK)
                        lo = c // width
                        hi = stop // width
                        decodeloop.scatter(
                            el[lo:hi], starts, low, vals, at // width + lo, at // width + hi
                        )
                        if h is not None:
                            h.update(raw[c:stop].data)
                at += size
        if h is not None:
            sums[r] = h.intdigest()
    return sums


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
