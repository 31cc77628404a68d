"""The static routing plan: who packs what, and who writes it where.

Pure, deterministic, and free of I/O: the same registrations and options give the
same plan and the same hash, whatever order they arrived in.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field, replace

import msgspec

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.plan import (
    MAX_SLOTS,
    Bucket,
    Expect,
    NodePlan,
    PackOp,
    RankPlan,
    WriteOp,
)
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import (
    ITEMSIZE,
    Box,
    Cast,
    Copy,
    DestTensor,
    Fp8BlockQuant,
    Fp8BlockScale,
    Piece,
    SourceTensor,
    Zeros,
    piece_nbytes,
    transformed_itemsize,
)

from .boxes import SubPiece, cover, place, split_rows
from .sources import SourceIndex


class PlanOptions(msgspec.Struct, frozen=True, kw_only=True):
    bucket_bytes: int = 256 << 20
    max_write_bytes: int = 32 << 20
    min_stripe_bytes: int = 1 << 20  # a write is striped over lanes only in parts this large
    allow_unused_sources: bool = False


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


@dataclass
class _Pack:
    source: str
    box: Box  # global
    local: Box  # the same, relative to what the chosen rank holds
    transform: object
    nbytes: int
    expert: bool
    order: tuple[int, ...]
    offset: int = -1  # in staging, or (zero-copy) in `region`
    region: int = -1  # >= 0: the bytes already lie in this region of the rank, as they are


@dataclass
class _Send:
    pack: _Pack
    dst_node: str
    dst_rank: int
    dst_region: int
    dst_offset: int
    nbytes: int


@dataclass
class _RankWork:
    holder_key: tuple[str, int]
    packs: dict[tuple[object, ...], _Pack] = field(default_factory=dict)
    sends: list[_Send] = field(default_factory=list)
    load: int = 0


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
    work: dict[tuple[str, int], _RankWork] = {
        (t.node, t.rank): _RankWork((t.node, t.rank)) for t in trainers
    }
    slots = slots if slots is not None else _slots(engines)
    expect_count: dict[int, int] = defaultdict(int)
    expect_bytes: dict[int, int] = defaultdict(int)
    expect_sources: dict[int, set[str]] = defaultdict(set)
    chunks_of: dict[Piece, list[tuple[Box, SubPiece]] | str] = {}
    checked: dict[tuple[object, ...], str | None] = {}

    for e in engines:
        regions = {r.id: r for r in e.regions}
        for t_index, dst in enumerate(e.tensors):
            problem = _check_destination(dst, regions, index, checked)
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
                        pack = _Pack(
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
                        _zero_copy(pack, chosen.tensor)
                        w.packs[key] = pack
                    w.load += placed.nbytes
                    w.sends.append(
                        _Send(
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
        buckets, staging = _layout(w, options, slots, expect_count, src_lanes[key], lanes)
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


def _check_destination(
    dst: DestTensor,
    regions: dict[int, RegionDescriptor],
    index: SourceIndex,
    memo: dict[tuple[object, ...], str | None],
) -> str | None:
    if dst.pieces is None:
        return f"{dst.name} has no recipe (no rule maps it)"
    region = regions.get(dst.region)
    if region is None:
        return f"{dst.name} lies in region {dst.region}, which the rank did not register"
    if dst.offset + dst.nbytes > region.length:
        return f"{dst.name} [{dst.offset}, +{dst.nbytes}) overruns region {dst.region}"
    key = (dst.name, dst.dtype, dst.shape, dst.pieces)  # engine replicas repeat them
    if key not in memo:
        memo[key] = _check_pieces(dst, index)
    return memo[key]


def _check_pieces(dst: DestTensor, index: SourceIndex) -> str | None:
    """The recipe's pieces: known sources, inside them, right dtypes, covering exactly."""
    assert dst.pieces is not None
    spans: list[tuple[int, int]] = []
    for piece in dst.pieces:
        if isinstance(piece.transform, Zeros):
            if piece.transform.dtype != dst.dtype:
                return (
                    f"{dst.name}: zero padding of {piece.transform.dtype} in a {dst.dtype} tensor"
                )
            spans.append((piece.dst_offset, piece.dst_offset + piece_nbytes(dst.dtype, piece)))
            continue
        meta = index.meta.get(piece.source)
        if meta is None:
            return f"{dst.name} needs source tensor {piece.source}, which no trainer declared"
        src_dtype, src_shape = meta
        if not piece.box.within(src_shape):
            return (
                f"{dst.name} reads {piece.source}{_fmt(piece.box)} outside its shape "
                f"{list(src_shape)}"
            )
        out_dtype = _out_dtype(src_dtype, piece)
        if out_dtype != dst.dtype:
            code = ErrorCode.DTYPE_MISMATCH.value
            return (
                f"{dst.name} is {dst.dtype} but {piece.source} ({src_dtype}) through "
                f"{type(piece.transform).__name__} gives {out_dtype} [{code}]"
            )
        spans.append((piece.dst_offset, piece.dst_offset + piece_nbytes(src_dtype, piece)))
    spans.sort()
    end = 0
    for lo, hi in spans:
        if lo != end:
            what = "overlap" if lo < end else "gap"
            return f"{dst.name}: its pieces {what} at byte {min(lo, end)} [shape_mismatch]"
        end = hi
    if end != dst.nbytes:
        return (
            f"{dst.name}: its pieces give {end} bytes, the tensor has {dst.nbytes} "
            f"({dst.dtype}{list(dst.shape)}) [shape_mismatch]"
        )
    return None


def _out_dtype(source_dtype: str, piece: Piece) -> str:
    match piece.transform:
        case Copy():
            return source_dtype
        case Cast(dtype=d) | Fp8BlockQuant(dtype=d):
            return d
        case Fp8BlockScale():
            return "float32"
        case Zeros(dtype=d):
            return d
    raise AssertionError(piece.transform)


def _chunks(
    piece: Piece, index: SourceIndex, options: PlanOptions
) -> list[tuple[Box, SubPiece]] | str:
    """A piece cut into parts single ranks hold, each at most a bucket; or the problem."""
    dtype = index.meta[piece.source][0]
    subs = cover(piece.box, index.held_boxes(piece.source))
    if not subs:
        return f" needs {piece.source}{_fmt(piece.box)}, which no trainer rank holds whole"
    out = []
    try:
        for sub in subs:
            for chunk in split_rows(sub, piece, dtype, options.bucket_bytes):
                out.append((chunk, place(piece, dtype, chunk)))
    except PlanError as exc:
        return f": {exc.message}"
    return out


def _zero_copy(pack: _Pack, held: SourceTensor) -> None:
    """Mark a pack zero-copy when its bytes already lie, as the engine wants them, in a
    region of the rank: an untransformed, contiguous part of a tensor declared in a region."""
    same = isinstance(pack.transform, Copy) or (
        isinstance(pack.transform, Cast) and pack.transform.dtype == held.dtype
    )
    if held.region < 0 or not same:
        return
    shape = held.held().sizes
    box = pack.local
    lead = next((d for d in range(len(shape)) if box.sizes[d] != 1), len(shape) - 1)
    if any(box.offsets[d] or box.sizes[d] != shape[d] for d in range(lead + 1, len(shape))):
        return  # not contiguous in the rank's tensor: it must be packed
    linear = 0
    for o, n in zip(box.offsets, shape, strict=True):
        linear = linear * n + o
    pack.region = held.region
    pack.offset = held.offset + linear * ITEMSIZE[held.dtype]


def _slots(engines: list[EngineRank]) -> dict[int, int]:
    per_node: dict[str, int] = defaultdict(int)
    slots: dict[int, int] = {}
    for e in engines:
        slots[e.rank] = per_node[e.node]
        per_node[e.node] += 1
        if slots[e.rank] >= MAX_SLOTS:
            raise PlanError(f"node {e.node} has more than {MAX_SLOTS} engine ranks")
    return slots


def _layout(
    w: _RankWork,
    options: PlanOptions,
    slots: dict[int, int],
    expect_count: dict[int, int],
    src_lanes: int = 1,
    dst_lanes: dict[int, int] | None = None,
) -> tuple[list[Bucket], int]:
    """Staging offsets (dense first, then experts), buckets, and merged, chunked writes."""
    packs = sorted(w.packs.values(), key=lambda p: (p.expert, p.order))
    offset = 0
    bucket_of: dict[int, int] = {}
    bucket_packs: list[list[_Pack]] = []
    bucket_kinds: list[str] = []
    filled = options.bucket_bytes  # forces a first bucket
    for p in packs:
        kind = "experts" if p.expert else "dense"
        if (filled + p.nbytes > options.bucket_bytes and filled > 0) or (
            bucket_kinds and bucket_kinds[-1] != kind
        ):
            bucket_packs.append([])
            bucket_kinds.append(kind)
            filled = 0
        if p.region < 0:  # zero-copy packs need no staging
            align = _alignment(p)
            offset = -(-offset // align) * align
            p.offset = offset
            offset += p.nbytes
        filled += p.nbytes
        bucket_packs[-1].append(p)
        bucket_of[id(p)] = len(bucket_packs) - 1

    sends_by_bucket: list[list[_Send]] = [[] for _ in bucket_packs]
    for s in w.sends:
        sends_by_bucket[bucket_of[id(s.pack)]].append(s)
    buckets: list[Bucket] = []
    for index, (bp, kind) in enumerate(zip(bucket_packs, bucket_kinds, strict=True)):
        writes = _writes(sends_by_bucket[index], options, slots, src_lanes, dst_lanes or {})
        for wr in writes:
            expect_count[wr.dst_rank] += 1
        buckets.append(
            Bucket(
                index=index,
                kind="experts" if kind == "experts" else "dense",
                packs=tuple(
                    PackOp(
                        source=p.source,
                        box=p.local,
                        transform=p.transform,  # type: ignore[arg-type]
                        staging_offset=p.offset,
                        nbytes=p.nbytes,
                    )
                    for p in bp
                    if p.region < 0
                ),
                writes=tuple(writes),
                nbytes=sum(p.nbytes for p in bp if p.region < 0),
            )
        )
    return buckets, offset


def _alignment(p: _Pack) -> int:
    return 4 if isinstance(p.transform, Fp8BlockScale) else 16


def _writes(
    sends: list[_Send],
    options: PlanOptions,
    slots: dict[int, int],
    src_lanes: int = 1,
    dst_lanes: dict[int, int] | None = None,
) -> list[WriteOp]:
    """Merge sends contiguous in both staging and destination, cut them into chunks, and
    stripe each chunk over the lanes both ends have (each stripe is a write of its own,
    with its own immediate, so the destination counts stripes exactly)."""
    order = sorted(
        sends,
        key=lambda s: (s.dst_node, s.dst_rank, s.dst_region, s.pack.region, s.pack.offset),
    )
    merged: list[list[int]] = []  # [src, length, dst_offset] + identity of the target
    targets: list[tuple[str, int, int, int]] = []  # (node, rank, dst region, src region)
    for s in order:
        target = (s.dst_node, s.dst_rank, s.dst_region, s.pack.region)
        if merged and targets[-1] == target:
            src, length, dst = merged[-1]
            if src + length == s.pack.offset and dst + length == s.dst_offset:
                merged[-1][1] += s.nbytes
                continue
        merged.append([s.pack.offset, s.nbytes, s.dst_offset])
        targets.append(target)
    out: list[WriteOp] = []
    src_lanes = max(1, src_lanes)
    for (src, length, dst), (node, rank, region, src_region) in zip(merged, targets, strict=True):
        lanes = max(1, min(src_lanes, (dst_lanes or {}).get(rank, 1)))
        for start in range(0, length, options.max_write_bytes):
            n = min(options.max_write_bytes, length - start)
            k = max(1, min(lanes, n // max(1, options.min_stripe_bytes)))
            step = -(-n // k)
            for i, part in enumerate(range(0, n, step)):
                out.append(
                    WriteOp(
                        src_offset=src + start + part,
                        length=min(step, n - part),
                        dst_node=node,
                        dst_region=region,
                        dst_offset=dst + start + part,
                        slot=slots[rank],
                        dst_rank=rank,
                        lane=(len(out) + i) % src_lanes if k == 1 else i % src_lanes,
                        src_region=src_region,
                    )
                )
    return out


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


def _fmt(box: Box) -> str:
    return (
        "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes, strict=True)) + "]"
    )


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … and {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["ITEMSIZE", "EngineRank", "PlanOptions", "TrainerRank", "plan", "transformed_itemsize"]
