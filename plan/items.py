"""The chunks of an engine rank's tensors, as arrays: one table per distinct tensor list,
built once however many engine ranks share it (replicas do), and laid end to end for the
ranks in rank order.

A chunk is a part of a piece one trainer rank holds whole, at most a bucket: it becomes
one send. Chunks that read the same bytes of the same source the same way share a key
(one pack per trainer rank that sends it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from weightwire.protocol.tensors import Box, DestTensor, Piece, Transform

from .boxes import SubPiece, cover, fmt_box, place, split_rows
from .checks import check_pieces
from .options import PlanOptions
from .ranks import is_expert
from .sources import SourceIndex

IntArray = npt.NDArray[np.int64]


@dataclass
class Keys:
    """What each chunk key reads: source, box (global), transform, bytes."""

    ids: dict[tuple[str, int], int] = field(default_factory=dict)  # (source, sub id) -> key
    source: list[str] = field(default_factory=list)
    box: list[Box] = field(default_factory=list)
    transform: list[Transform] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    def add(self, source: str, box: Box, transform: Transform, nbytes: int) -> int:
        self.source.append(source)
        self.box.append(box)
        self.transform.append(transform)
        self.nbytes.append(nbytes)
        return len(self.source) - 1


@dataclass
class Table:
    """The chunks of one tensor list, in (tensor, piece, chunk) order."""

    key: IntArray
    group: IntArray  # candidate group (index into Chunker.groups)
    nbytes: IntArray
    dst_offset: IntArray  # in the destination region
    region: IntArray
    expert: npt.NDArray[np.bool_]
    block: IntArray  # destination offset // bucket_bytes
    problems: list[str]  # recipe problems (region ones are the rank's)
    regions: dict[int, int]  # destination region -> end of the last tensor in it
    sources: set[str]

    def __len__(self) -> int:
        return int(self.key.shape[0])


class Chunker:
    def __init__(self, index: SourceIndex, options: PlanOptions) -> None:
        self.index = index
        self.options = options
        self.keys = Keys()
        self.groups: list[tuple[int, ...]] = []
        self._group_ids: dict[tuple[int, ...], int] = {}
        self._parts: dict[tuple[object, ...], list[tuple[int, Box, int, int, int]] | None] = {}
        self._subs: dict[tuple[object, ...], int] = {}  # (source shape, sub-box, transform)
        self._checked: dict[tuple[object, ...], str | None] = {}
        self._tables: dict[int, tuple[tuple[DestTensor, ...], Table]] = {}

    def table(self, tensors: tuple[DestTensor, ...]) -> Table:
        hit = self._tables.get(id(tensors))
        if hit is not None and hit[0] is tensors:
            return hit[1]
        table = self._build(tensors)
        self._tables[id(tensors)] = (tensors, table)
        return table

    def _build(self, tensors: tuple[DestTensor, ...]) -> Table:
        bucket = self.options.bucket_bytes
        cols: list[list[int]] = [[] for _ in range(6)]
        key, group, nbytes, dst_off, region, block = cols
        expert: list[bool] = []
        problems: list[str] = []
        regions: dict[int, int] = {}
        sources: set[str] = set()
        for dst in tensors:
            end = dst.offset + dst.nbytes
            if regions.get(dst.region, -1) < end:
                regions[dst.region] = end
            problem = self.check(dst)
            if problem:
                problems.append(problem)
                continue
            assert dst.pieces is not None
            dst_expert = is_expert(dst.name)
            for piece in dst.pieces:
                if not piece.sent:
                    continue
                source = piece.source
                sources.add(source)
                parts = self.parts(piece)
                if parts is None:
                    problems.append(f"{dst.name}: cannot be cut")
                    continue
                ex = dst_expert or ".experts." in source
                transform = piece.transform
                ids = self.keys.ids
                at = dst.offset + piece.dst_offset
                for sub_id, sub, size, rel, g in parts:
                    k = ids.get((source, sub_id))
                    if k is None:
                        k = ids[(source, sub_id)] = self.keys.add(source, sub, transform, size)
                    key.append(k)
                    group.append(g)
                    nbytes.append(size)
                    dst_off.append(at + rel)
                    region.append(dst.region)
                    expert.append(ex)
                    block.append(dst.offset // bucket)
        arr = [np.asarray(c, dtype=np.int64) for c in cols]
        return Table(
            key=arr[0],
            group=arr[1],
            nbytes=arr[2],
            dst_offset=arr[3],
            region=arr[4],
            expert=np.asarray(expert, dtype=bool),
            block=arr[5],
            problems=problems,
            regions=regions,
            sources=sources,
        )

    def check(self, dst: DestTensor) -> str | None:
        """Whether the recipe is sound (its problem, named, comes from the plain path):
        memoized by shape, so that the layers of a model are checked once."""
        if dst.pieces is None:
            return "no recipe"
        ids = self.index.shape_id
        memo_key = (
            dst.dtype,
            dst.shape,
            tuple((ids.get(p.source, -1), p.box, p.dst_offset, p.transform) for p in dst.pieces),
        )
        if memo_key not in self._checked:
            self._checked[memo_key] = check_pieces(dst, self.index)
        return self._checked[memo_key]

    def parts(self, piece: Piece) -> list[tuple[int, Box, int, int, int]] | None:
        """(sub id, sub-box, bytes, offset from the piece's, candidate group) of each chunk
        of a piece, or None when it cannot be cut (the plain path says why); memoized by
        the source's shape and holders, not its name (layers repeat). A sub id names a
        sub-box and transform of a source shape: with the source's name, a chunk key."""
        shape = self.index.shape_id[piece.source]
        memo_key = (shape, piece.box, piece.transform)
        if memo_key in self._parts:
            hit = self._parts[memo_key]
        else:
            chunks = self.chunks(piece)
            hit = None
            if not isinstance(chunks, str):
                at = piece.dst_offset
                subs = self._subs
                hit = [
                    (
                        subs.setdefault((shape, sub, piece.transform), len(subs)),
                        sub,
                        placed.nbytes,
                        placed.dst_offset - at,
                        self.group(piece.source, sub),
                    )
                    for sub, placed in chunks
                ]
            self._parts[memo_key] = hit
        return hit

    def chunks(self, piece: Piece) -> list[tuple[Box, SubPiece]] | str:
        """A piece cut into parts single ranks hold, each at most a bucket (of the tail's
        size, `PlanOptions.chunk_bytes`); or the problem."""
        return _chunks(piece, self.index, self.options)

    def group(self, source: str, sub: Box) -> int:
        cand = self.index.candidates(source, sub)
        g = self._group_ids.get(cand)
        if g is None:
            g = self._group_ids[cand] = len(self.groups)
            self.groups.append(cand)
        return g


def _chunks(
    piece: Piece, index: SourceIndex, options: PlanOptions
) -> list[tuple[Box, SubPiece]] | str:
    dtype = index.meta[piece.source][0]
    subs = cover(piece.box, index.held_boxes(piece.source))
    if not subs:
        return f" needs {piece.source}{fmt_box(piece.box)}, which no trainer rank holds whole"
    from weightwire.protocol.errors import PlanError

    out = []
    try:
        for sub in subs:
            for chunk in split_rows(sub, piece, dtype, options.chunk_bytes):
                out.append((chunk, place(piece, dtype, chunk)))
    except PlanError as exc:
        return f": {exc.message}"
    return out
