"""The static routing plan: who packs what, and who writes it where.

Pure, deterministic, and free of I/O: the same registrations and options give the
same plan and the same hash, whatever order they arrived in.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, replace

import msgspec

from weightwire.protocol.errors import PlanError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.plan import (
    MAX_SLOTS,
    Expect,
    NodePlan,
    RankPlan,
)
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import (
    ITEMSIZE,
    Box,
    DestTensor,
    Piece,
    SourceTensor,
    transformed_itemsize,
)

from .boxes import SubPiece, cover, fmt_box, place, split_rows
from .checks import check_destination
from .layout import Pack, RankWork, Send, layout, zero_copy
from .options import PlanOptions
from .sources import SourceIndex


@dataclass(frozen=True)
class TrainerRank:
    node: str
    rank: int
    tensors: tuple[SourceTensor, ...]
    lanes: int = 1  # NICs its node has for it: writes are striped over them


@dataclass(frozen=True)
class EngineRank:
    node: str
    rank: int
    tensors: tuple[DestTensor, ...]  # each with its pieces resolved
    regions: tuple[RegionDescriptor, ...]
    slot: int = -1  # its immediate counter on its node (-1: numbered here)
    layout: EngineLayout | None = None  # for tensors whose recipes are left to the rules
    lanes: int = 1


def resolve_recipes(engines: list[EngineRank]) -> list[EngineRank]:
    """Engine ranks with every recipe filled in: those left to the rules come from the
    model-family rules and the rank's layout. Raises PlanError naming every problem."""
    from .rules import resolve

    out: list[EngineRank] = []
    problems: list[str] = []
    for e in engines:
        if all(t.pieces is not None for t in e.tensors):
            out.append(e)
            continue
        if e.layout is None:
            problems.append(f"engine rank {e.rank} left recipes to the rules but gave no layout")
            continue
        try:
            out.append(replace(e, tensors=resolve(e.tensors, e.layout)))
        except PlanError as exc:
            problems.append(f"engine rank {e.rank}: {exc.message}")
    if problems:
        raise PlanError("\n  ".join(problems))
    return out


def caveats_of(engines: list[EngineRank]) -> list[str]:
    """The rules' caveats (`rules.caveats`) for every engine layout of a job, each once."""
    from .rules import caveats

    out: dict[str, None] = {}
    for e in engines:
        if e.layout is not None and e.layout.model:
            try:
                out.update(dict.fromkeys(caveats(e.layout.model, e.layout)))
            except PlanError:
                continue  # resolving the recipes reports what is wrong with the layout
    return list(out)


def is_expert(name: str) -> bool:
    return ".experts." in name


def plan(
    job: str,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    options: PlanOptions | None = None,
    slots: dict[int, int] | None = None,
) -> dict[str, NodePlan]:
    """The per-node plans of a job. Raises PlanError naming every problem found.

    `slots` gives each engine rank its immediate counter on its node (unique across the
    jobs a node serves); by default ranks are numbered per node from 0.
    """
    options = options or PlanOptions()
    trainers = sorted(trainers, key=lambda t: t.rank)
    engines = sorted(engines, key=lambda e: e.rank)
    index = SourceIndex([(t.node, t.rank, t.tensors) for t in trainers])
    problems: list[str] = []
    used: set[str] = set()
    work: dict[tuple[str, int], RankWork] = {(t.node, t.rank): RankWork() for t in trainers}
    slots = slots if slots is not None else _slots(engines)
    expect_count: dict[int, int] = defaultdict(int)
    expect_bytes: dict[int, int] = defaultdict(int)
    expect_sources: dict[int, set[str]] = defaultdict(set)
    chunks_of: dict[Piece, list[tuple[Box, SubPiece]] | str] = {}
    checked: dict[tuple[object, ...], str | None] = {}

    for e in engines:
        regions = {r.id: r for r in e.regions}
        for t_index, dst in enumerate(e.tensors):
            problem = check_destination(dst, regions, index, checked)
            if problem:
                problems.append(f"engine rank {e.rank}: {problem}")
                continue
            assert dst.pieces is not None
            for p_index, piece in enumerate(dst.pieces):
                if not piece.sent:
                    continue
                used.add(piece.source)
                chunks = chunks_of.get(piece)
                if chunks is None:  # engine replicas repeat pieces: cut each one once
                    chunks = chunks_of[piece] = _chunks(piece, index, options)
                if isinstance(chunks, str):
                    problems.append(f"engine rank {e.rank}: {dst.name}{chunks}")
                    continue
                for sub, placed in chunks:
                    chosen = index.choose(piece.source, sub)
                    index.charge(chosen, placed.nbytes)
                    w = work[(chosen.node, chosen.rank)]
                    key = (piece.source, sub, piece.transform)
                    pack = w.packs.get(key)
                    if pack is None:
                        pack = Pack(
                            source=piece.source,
                            box=sub,
                            local=sub.relative_to(chosen.tensor.held()),
                            transform=piece.transform,
                            nbytes=placed.nbytes,
                            expert=is_expert(piece.source) or is_expert(dst.name),
                            # engines interleave block by block (so every engine is fed
                            # from the start while the rank packs), each block in its
                            # tensor order (so neighbouring tensors merge into one write)
                            order=(dst.offset // options.bucket_bytes, e.rank, t_index, p_index),
                        )
                        zero_copy(pack, chosen.tensor)
                        w.packs[key] = pack
                    w.sends.append(
                        Send(
                            pack=pack,
                            dst_node=e.node,
                            dst_rank=e.rank,
                            dst_region=dst.region,
                            dst_offset=dst.offset + placed.dst_offset,
                            nbytes=placed.nbytes,
                        )
                    )
                    expect_bytes[e.rank] += placed.nbytes
                    expect_sources[e.rank].add(chosen.node)

    unused = sorted(set(index.boxes) - used)
    if unused and not options.allow_unused_sources:
        problems.append(f"source tensors no destination uses: {_names(unused)}")
    if problems:
        raise PlanError("cannot plan job " + repr(job) + ":\n  " + "\n  ".join(problems))

    region_by_key = {(e.node, r.id): r for e in engines for r in e.regions}
    rank_plans: dict[tuple[str, int], RankPlan] = {}
    lanes = {e.rank: e.lanes for e in engines}
    src_lanes = {(t.node, t.rank): t.lanes for t in trainers}
    for key, w in sorted(work.items()):
        buckets, staging = layout(w, options, slots, expect_count, src_lanes[key], lanes)
        regions = sorted({(s.dst_node, s.dst_region) for s in w.sends}, key=lambda r: (r[0], r[1]))
        rank_plans[key] = RankPlan(
            plan_hash="",
            rank=key[1],
            staging_bytes=staging,
            buckets=tuple(buckets),
            regions=tuple(region_by_key[r] for r in regions),
        )

    expects_by_node: dict[str, list[Expect]] = defaultdict(list)
    for e in engines:
        expects_by_node[e.node].append(
            Expect(
                rank=e.rank,
                slot=slots[e.rank],
                count=expect_count[e.rank],
                nbytes=expect_bytes[e.rank],
                sources=tuple(sorted(expect_sources[e.rank])),
            )
        )
    digest = _hash(job, trainers, engines, options, rank_plans, expects_by_node)
    nodes = {t.node for t in trainers} | {e.node for e in engines}
    out: dict[str, NodePlan] = {}
    for node in sorted(nodes):
        sends = tuple(
            msgspec.structs.replace(rp, plan_hash=digest)
            for (n, _), rp in sorted(rank_plans.items())
            if n == node
        )
        out[node] = NodePlan(
            plan_hash=digest, job=job, sends=sends, expects=tuple(expects_by_node.get(node, ()))
        )
    return out


def _chunks(
    piece: Piece, index: SourceIndex, options: PlanOptions
) -> list[tuple[Box, SubPiece]] | str:
    """A piece cut into parts single ranks hold, each at most a bucket; or the problem."""
    dtype = index.meta[piece.source][0]
    subs = cover(piece.box, index.held_boxes(piece.source))
    if not subs:
        return f" needs {piece.source}{fmt_box(piece.box)}, which no trainer rank holds whole"
    out = []
    try:
        for sub in subs:
            for chunk in split_rows(sub, piece, dtype, options.bucket_bytes):
                out.append((chunk, place(piece, dtype, chunk)))
    except PlanError as exc:
        return f": {exc.message}"
    return out


def _slots(engines: list[EngineRank]) -> dict[int, int]:
    per_node: dict[str, int] = defaultdict(int)
    slots: dict[int, int] = {}
    for e in engines:
        slots[e.rank] = per_node[e.node]
        per_node[e.node] += 1
        if slots[e.rank] >= MAX_SLOTS:
            raise PlanError(f"node {e.node} has more than {MAX_SLOTS} engine ranks")
    return slots


def _hash(
    job: str,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    options: PlanOptions,
    rank_plans: dict[tuple[str, int], RankPlan],
    expects: dict[str, list[Expect]],
) -> str:
    h = hashlib.sha256()
    enc = msgspec.msgpack.Encoder(order="deterministic")
    h.update(enc.encode([job, options]))
    encoded: dict[int, bytes] = {}  # ranks often share one declaration: encode it once
    for t in trainers:
        if id(t.tensors) not in encoded:
            encoded[id(t.tensors)] = hashlib.sha256(enc.encode(t.tensors)).digest()
        h.update(enc.encode([t.node, t.rank, t.lanes]))
        h.update(encoded[id(t.tensors)])
    for e in engines:
        h.update(enc.encode([e.node, e.rank, e.tensors, [(r.id, r.length) for r in e.regions]]))
    for key, rp in sorted(rank_plans.items()):
        h.update(enc.encode([key, rp]))
    for node, ex in sorted(expects.items()):
        h.update(enc.encode([node, ex]))
    return h.hexdigest()[:16]


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … and {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["ITEMSIZE", "EngineRank", "PlanOptions", "TrainerRank", "plan", "transformed_itemsize"]
