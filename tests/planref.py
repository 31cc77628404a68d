"""The straightforward planner, as it was before the columnar one (weightwire.plan): one
piece at a time, a Pack and a Send object each, a bucket's writes merged, chunked and
gathered with Python lists. Kept as the reference the fast planner must equal write for
write (tests/test_plan_equivalence.py); `legacy_hash` is the hash it computed, over every
rank's encoded plan."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from weightwire.plan.boxes import SubPiece
from weightwire.plan.checks import check_destination
from weightwire.plan.items import _chunks
from weightwire.plan.options import PlanOptions
from weightwire.plan.planner import EngineRank, TrainerRank, _slots, is_expert
from weightwire.plan.ranks import _names
from weightwire.plan.sources import SourceIndex
from weightwire.protocol.errors import PlanError
from weightwire.protocol.plan import Bucket, Expect, NodePlan, PackOp, RankPlan, WriteOp
from weightwire.protocol.tensors import (
    ITEMSIZE,
    Box,
    Cast,
    Copy,
    Fp8BlockScale,
    Piece,
    SourceTensor,
)

Target = tuple[str, int, int, int]  # (node, engine rank, destination region, source region)


class _Run:
    """Chunks of `n` bytes, block i at src + i * src_stride -> dst + i * dst_stride."""

    __slots__ = ("count", "dst", "dst_stride", "n", "src", "src_stride", "target")

    def __init__(self, src: int, n: int, dst: int, target: Target) -> None:
        self.src, self.n, self.dst, self.target = src, n, dst, target
        self.count, self.src_stride, self.dst_stride = 1, 0, 0

    def extend(self, src: int, dst: int, cap: int) -> bool:
        """Take the chunk at (src, dst) as the next block, if it continues the run."""
        if (self.count + 1) * self.n > cap:
            return False
        if self.count == 1:
            ss, ds = src - self.src, dst - self.dst
            if ss < self.n or ds < self.n:
                return False
            self.src_stride, self.dst_stride = ss, ds
        elif (
            src != self.src + self.count * self.src_stride
            or dst != self.dst + self.count * self.dst_stride
        ):
            return False
        self.count += 1
        return True


def writes_of(
    sends: list[Send],
    options: PlanOptions,
    slots: dict[int, int],
    src_lanes: int = 1,
    dst_lanes: dict[int, int] | None = None,
) -> list[WriteOp]:
    """The writes of one bucket's sends. Each write has its own immediate, so the
    destination counts writes (stripes included) exactly."""
    runs = _runs(_write_chunks(sends, options.max_write_bytes), options.max_write_bytes)
    out: list[WriteOp] = []
    src_lanes = max(1, src_lanes)
    for r in runs:
        node, rank, region, src_region = r.target
        lanes = max(1, min(src_lanes, (dst_lanes or {}).get(rank, 1)))
        k = max(1, min(lanes, r.n * r.count // max(1, options.min_stripe_bytes)))
        if r.count == 1:  # stripes: byte ranges of the chunk
            step = -(-r.n // k)
            parts = [(r.src + p, min(step, r.n - p), r.dst + p, 1) for p in range(0, r.n, step)]
        else:  # stripes: whole blocks of the run
            per = -(-r.count // min(k, r.count))
            parts = [
                (r.src + b * r.src_stride, r.n, r.dst + b * r.dst_stride, min(per, r.count - b))
                for b in range(0, r.count, per)
            ]
        for i, (src, n, dst, count) in enumerate(parts):
            out.append(
                WriteOp(
                    src_offset=src,
                    length=n,
                    dst_node=node,
                    dst_region=region,
                    dst_offset=dst,
                    slot=slots[rank],
                    dst_rank=rank,
                    lane=(len(out) + i) % src_lanes if len(parts) == 1 else i % src_lanes,
                    src_region=src_region,
                    count=count,
                    src_stride=r.src_stride if count > 1 else 0,
                    dst_stride=r.dst_stride if count > 1 else 0,
                )
            )
    return out


def _write_chunks(sends: list[Send], cap: int) -> list[tuple[int, int, int, Target]]:
    """(src, n, dst, target) of every chunk: sends merged where contiguous at both ends,
    then cut at `cap` bytes."""
    order = sorted(
        sends,
        key=lambda s: (s.dst_node, s.dst_rank, s.dst_region, s.pack.region, s.pack.offset),
    )
    merged: list[list[int]] = []  # [src, length, dst]
    targets: list[Target] = []
    for s in order:
        target = (s.dst_node, s.dst_rank, s.dst_region, s.pack.region)
        if merged and targets[-1] == target:
            src, length, dst = merged[-1]
            if src + length == s.pack.offset and dst + length == s.dst_offset:
                merged[-1][1] += s.nbytes
                continue
        merged.append([s.pack.offset, s.nbytes, s.dst_offset])
        targets.append(target)
    return [
        (src + start, min(cap, length - start), dst + start, target)
        for (src, length, dst), target in zip(merged, targets, strict=True)
        for start in range(0, length, cap)
    ]


def _runs(chunks: list[tuple[int, int, int, Target]], cap: int) -> list[_Run]:
    """Chunks of one target and size, in source order, gathered while they stay evenly
    spaced at both ends (and the run within `cap` bytes)."""
    runs: list[_Run] = []
    open_runs: dict[tuple[Target, int], _Run] = {}
    for src, n, dst, target in sorted(chunks, key=lambda c: (c[3], c[1], c[0])):
        run = open_runs.get((target, n))
        if run is None or not run.extend(src, dst, cap):
            run = open_runs[(target, n)] = _Run(src, n, dst, target)
            runs.append(run)
    return runs


@dataclass
class Pack:
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
class Send:
    pack: Pack
    dst_node: str
    dst_rank: int
    dst_region: int
    dst_offset: int
    nbytes: int


@dataclass
class RankWork:
    packs: dict[tuple[object, ...], Pack] = field(default_factory=dict)
    sends: list[Send] = field(default_factory=list)


def zero_copy(pack: Pack, held: SourceTensor) -> None:
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


def layout(
    w: RankWork,
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
    bucket_packs: list[list[Pack]] = []
    bucket_kinds: list[str] = []
    filled = options.bucket_bytes  # forces a first bucket
    # the send's last bucket_bytes, from the first pack ending within them (of the last
    # kind), in buckets of at most tail_bytes
    tail_at, cap = len(packs), options.bucket_bytes
    if 0 < options.tail_bytes < options.bucket_bytes:
        left = 0
        while (
            tail_at > 0
            and packs[tail_at - 1].expert == packs[-1].expert
            and left + packs[tail_at - 1].nbytes <= options.bucket_bytes
        ):
            tail_at -= 1
            left += packs[tail_at].nbytes
    for i, p in enumerate(packs):
        kind = "experts" if p.expert else "dense"
        if i == tail_at:
            cap = options.tail_bytes
        if (
            (filled + p.nbytes > cap and filled > 0)
            or (bucket_kinds and bucket_kinds[-1] != kind)
            or (i == tail_at and bucket_packs and bucket_packs[-1] and _last_kind(packs, i))
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

    sends_by_bucket: list[list[Send]] = [[] for _ in bucket_packs]
    for s in w.sends:
        sends_by_bucket[bucket_of[id(s.pack)]].append(s)
    buckets: list[Bucket] = []
    for index, (bp, kind) in enumerate(zip(bucket_packs, bucket_kinds, strict=True)):
        writes = writes_of(sends_by_bucket[index], options, slots, src_lanes, dst_lanes or {})
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


def _last_kind(packs: list[Pack], i: int) -> bool:
    """Pack i starts the tail within its kind's run (not at its first pack, which starts a
    bucket anyway)."""
    return i > 0 and packs[i - 1].expert == packs[i].expert


def _alignment(p: Pack) -> int:
    return 4 if isinstance(p.transform, Fp8BlockScale) else 16


def plan_reference(
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
    digest = legacy_hash(job, trainers, engines, options, rank_plans, expects_by_node)
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


def legacy_hash(
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
