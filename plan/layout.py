"""One trainer rank's side of the plan: its packs laid out in staging (dense first, then
experts, engines interleaved block by block), cut into buckets, and the writes that move
them (`writes`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from weightwire.protocol.plan import Bucket, PackOp
from weightwire.protocol.tensors import ITEMSIZE, Box, Cast, Copy, Fp8BlockScale, SourceTensor

from .options import PlanOptions
from .writes import writes_of


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


def _alignment(p: Pack) -> int:
    return 4 if isinstance(p.transform, Fp8BlockScale) else 16
