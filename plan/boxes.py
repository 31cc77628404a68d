"""Cutting a destination piece into sub-pieces that single source ranks hold.

A sub-piece must land contiguously in the destination: a box is contiguous in the
row-major layout of its piece when, before the one dimension it is cut on, every
dimension has size 1, and after it every dimension is whole.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from weightwire.protocol.errors import PlanError
from weightwire.protocol.tensors import (
    Box,
    Fp8BlockQuant,
    Fp8BlockScale,
    Piece,
    piece_nbytes,
    transformed_itemsize,
)


@dataclass(frozen=True, slots=True)
class SubPiece:
    box: Box  # global coordinates of the source tensor
    dst_offset: int  # bytes from the start of the destination tensor
    nbytes: int


def cover(box: Box, holders: list[Box]) -> list[Box]:
    """Split `box` into contiguous sub-boxes each inside one of `holders`."""
    if any(_contains(h, box) for h in holders):
        return [box]
    dim = _first_cut_dim(box, holders)
    if dim is None:
        return []  # some part of the box is held by nobody
    lead = next((d for d in range(len(box.sizes)) if box.sizes[d] != 1), dim)
    if lead < dim:  # cut on a later dimension: make the leading ones unit-sized first
        parts = [_unit(box, lead, i) for i in range(box.sizes[lead])]
    else:
        cuts = sorted(
            {box.offsets[dim], box.offsets[dim] + box.sizes[dim]}
            | {
                edge
                for h in holders
                for edge in (h.offsets[dim], h.offsets[dim] + h.sizes[dim])
                if box.offsets[dim] < edge < box.offsets[dim] + box.sizes[dim]
            }
        )
        parts = [_slab(box, dim, lo, hi) for lo, hi in itertools.pairwise(cuts)]
    out: list[Box] = []
    for part in parts:
        relevant = [h for h in holders if part.intersect(h) is not None]
        sub = cover(part, relevant)
        if not sub:
            return []
        out.extend(sub)
    return out


def _contains(outer: Box, inner: Box) -> bool:
    return all(
        o <= i and i + n <= o + m
        for o, m, i, n in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes, strict=True)
    )


def _first_cut_dim(box: Box, holders: list[Box]) -> int | None:
    for d in range(len(box.sizes)):
        lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
        for h in holders:
            if h.intersect(box) is None:
                continue
            if lo < h.offsets[d] < hi or lo < h.offsets[d] + h.sizes[d] < hi:
                return d
    return None


def _unit(box: Box, dim: int, i: int) -> Box:
    return _slab(box, dim, box.offsets[dim] + i, box.offsets[dim] + i + 1)


def _slab(box: Box, dim: int, lo: int, hi: int) -> Box:
    offs, sizes = list(box.offsets), list(box.sizes)
    offs[dim], sizes[dim] = lo, hi - lo
    return Box(offsets=tuple(offs), sizes=tuple(sizes))


def place(piece: Piece, source_dtype: str, sub: Box) -> SubPiece:
    """Where a (contiguous) sub-box of a piece lands, in bytes of the destination tensor."""
    rel = sub.relative_to(piece.box)
    match piece.transform:
        case Fp8BlockScale(block=b) | Fp8BlockQuant(block=b):
            _check_blocks(piece, rel, b)
    if isinstance(piece.transform, Fp8BlockScale):
        b = piece.transform.block
        shape = (*piece.box.sizes[:-2], -(-piece.box.sizes[-2] // b), -(-piece.box.sizes[-1] // b))
        first = (*rel.offsets[:-2], rel.offsets[-2] // b, rel.offsets[-1] // b)
        itemsize = 4
        sub_piece = Piece(source=piece.source, box=sub, dst_offset=0, transform=piece.transform)
        nbytes = piece_nbytes(source_dtype, sub_piece)
    else:
        shape = piece.box.sizes
        first = rel.offsets
        itemsize = transformed_itemsize(source_dtype, piece.transform)
        nbytes = sub.numel * itemsize
    linear = 0
    for idx, n in zip(first, shape, strict=True):
        linear = linear * n + idx
    return SubPiece(box=sub, dst_offset=piece.dst_offset + linear * itemsize, nbytes=nbytes)


def _check_blocks(piece: Piece, rel: Box, block: int) -> None:
    """FP8 tiles must not be split between sources: each needs its whole tile for the scale."""
    if len(rel.sizes) < 2:
        raise PlanError(f"FP8 block quantization of {piece.source} needs a 2-D (or stacked) box")
    for d in (-2, -1):
        start, end, whole = rel.offsets[d], rel.offsets[d] + rel.sizes[d], piece.box.sizes[d]
        if start % block or (end % block and end != whole):
            raise PlanError(
                f"FP8 block quantization of {piece.source} needs whole {block}x{block} tiles, "
                f"but the sources hold it split at {start}..{end} on dim {len(rel.sizes) + d}"
            )


def split_rows(box: Box, piece: Piece, source_dtype: str, max_bytes: int) -> list[Box]:
    """Cut a sub-box along its first dimension into parts of at most ~`max_bytes`, so a
    large tensor spans several buckets and its packing overlaps its transfer. FP8 tiles
    are never cut: 2-D boxes split at whole tiles. A 0-d box (a scalar) is one part."""
    if not box.sizes:
        return [box]
    rows = box.sizes[0]
    if isinstance(piece.transform, Fp8BlockScale):
        nbytes = place(piece, source_dtype, box).nbytes
    else:
        nbytes = box.numel * transformed_itemsize(source_dtype, piece.transform)
    if nbytes <= max_bytes or rows <= 1:
        return [box]
    step = max(1, rows * max_bytes // nbytes)
    if isinstance(piece.transform, Fp8BlockQuant | Fp8BlockScale) and len(box.sizes) == 2:
        block = piece.transform.block
        step = max(block, step // block * block)
    lo = box.offsets[0]
    return [_slab(box, 0, r, min(r + step, lo + rows)) for r in range(lo, lo + rows, step)]


def fmt_box(box: Box) -> str:
    return (
        "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.sizes, strict=True)) + "]"
    )
