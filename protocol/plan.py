"""The routing plan, as data: what each trainer rank packs and writes, what each engine expects.

Computing a plan is `weightwire.plan`'s job; this module only says what one is.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .regions import RegionDescriptor
from .tensors import Box, NonNeg, Transform

IMM_VERSION_BITS = 16
IMM_SLOT_BITS = 16
MAX_SLOTS = 1 << IMM_SLOT_BITS


def version_low(version: int) -> int:
    """The low bits of a version, as an immediate carries them."""
    return version & ((1 << IMM_VERSION_BITS) - 1)


def encode_imm(version: int, slot: int) -> int:
    """The 32-bit immediate of a write: the version's low bits and the destination's counter."""
    return (version_low(version) << IMM_SLOT_BITS) | (slot & (MAX_SLOTS - 1))


def decode_imm(imm: int) -> tuple[int, int]:
    """(version low bits, slot) of an immediate."""
    return version_low(imm >> IMM_SLOT_BITS), imm & (MAX_SLOTS - 1)


Range = tuple[NonNeg, NonNeg, NonNeg, NonNeg, NonNeg]
"""(region, offset, length, count, stride) of a write at its destination."""


class PackOp(msgspec.Struct, frozen=True, kw_only=True):
    """Fill `nbytes` of staging at `staging_offset` from `box` (in the rank's local tensor).

    `box` is relative to what the rank holds of `source`, so a rank never needs the
    global picture to pack.
    """

    source: str
    box: Box
    transform: Transform
    staging_offset: NonNeg
    nbytes: NonNeg


class WriteOp(msgspec.Struct, frozen=True, kw_only=True):
    """One write: staging bytes to a destination region, counted in `slot` on arrival.

    A strided write (`count` > 1) is `count` blocks of `length` bytes, block i from
    `src_offset + i * src_stride` to `dst_offset + i * dst_stride`, with one immediate
    after the last block landed: the same tensor's slice of many experts in one write.
    """

    src_offset: NonNeg
    length: Annotated[int, msgspec.Meta(gt=0)]
    dst_node: str
    dst_region: NonNeg
    dst_offset: NonNeg
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
    dst_rank: NonNeg = 0
    lane: NonNeg = 0  # which of the source's paths (NIC) carries it; stripes of one write differ
    src_region: int = -1  # -1: the staging region; else a region the rank registered (zero-copy)
    count: Annotated[int, msgspec.Meta(ge=1)] = 1
    src_stride: NonNeg = 0
    dst_stride: NonNeg = 0

    def __post_init__(self) -> None:
        check_blocks(self.length, self.count, self.src_stride, self.dst_stride)

    @property
    def nbytes(self) -> int:
        """The bytes it moves (all blocks)."""
        return self.length * self.count

    def blocks(self) -> list[tuple[int, int]]:
        """(source offset, destination offset) of each block."""
        return [
            (self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride)
            for i in range(self.count)
        ]


def check_blocks(length: int, count: int, src_stride: int, dst_stride: int) -> None:
    """Raises ValueError unless the blocks of a strided write are well formed: at least one,
    and, when several, strides of at least `length` (blocks never overlap)."""
    if count < 1:
        raise ValueError(f"a write has at least one block, got count={count}")
    if count > 1 and (src_stride < length or dst_stride < length):
        raise ValueError(
            f"strided write of {count} blocks of {length} bytes with strides "
            f"{src_stride}/{dst_stride}: blocks would overlap (strides must be >= length)"
        )


def span(length: int, count: int, stride: int) -> int:
    """Bytes from a strided write's first byte to its last, on one side."""
    return (count - 1) * stride + length


# Sizes in an engine's delta area (see weightwire.client.delta.frames).
DELTA_HEAD = 64  # a payload's or a trailer's header
DELTA_RANGE = 40  # one (region, offset, length, count, stride) entry
DELTA_REF = 16  # one (offset, length) entry


def trailer_capacity(n_ranges: int, n_deltas: int) -> int:
    return DELTA_HEAD + DELTA_RANGE * n_ranges + DELTA_REF * n_deltas


class DeltaSpot(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes a rank encodes at `src_offset` of its delta-out region and writes at `dst_offset`
    of one engine rank's delta area (at most `capacity` bytes): the fields a DeltaSlot and a
    Trailer share, in their wire order."""

    dst_node: str
    dst_rank: NonNeg
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
    dst_region: NonNeg
    dst_offset: NonNeg
    capacity: NonNeg
    src_offset: NonNeg


class DeltaSlot(DeltaSpot, frozen=True, kw_only=True):
    """A bucket's bytes for one engine rank, which the rank may send as a delta payload:
    encoded at `src_offset` of its delta-out region, written at `dst_offset` of that engine's delta
    area (at most `capacity` bytes), in as many writes as the dense `writes` it replaces
    (indices into the bucket's writes), so the engine's immediate count stays the same."""

    writes: tuple[NonNeg, ...]
    width: Annotated[int, msgspec.Meta(ge=1, le=8)] = 2


class Trailer(DeltaSpot, frozen=True, kw_only=True):
    """The last write of a version from a rank to one engine rank (delta-capable plans):
    the checksum of everything the rank wrote there and where its payloads are."""


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    index: NonNeg
    kind: Literal["dense", "experts"] = "dense"
    packs: tuple[PackOp, ...] = ()
    writes: tuple[WriteOp, ...] = ()
    nbytes: NonNeg = 0  # staging bytes packed by this bucket
    deltas: tuple[DeltaSlot, ...] = ()


class ReplicaPart(msgspec.Struct, frozen=True, kw_only=True):
    """One engine replica of an elastic job, as a trainer rank's plan sees it: its writes
    are those to `ranks`, planned on their own (`plan_hash`), so that replicas come and go
    without changing the others' writes."""

    replica: int
    plan_hash: str
    ranks: tuple[NonNeg, ...]
    nodes: tuple[str, ...]


class RankPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one trainer rank does per version, in order.

    In an elastic job `plan_hash` names the packs only (the same for every set of engine
    replicas), and `replicas` says which writes go to which replica."""

    plan_hash: str
    rank: NonNeg
    staging_bytes: NonNeg
    buckets: tuple[Bucket, ...]
    regions: tuple[RegionDescriptor, ...] = ()  # every destination region it writes to
    trailers: tuple[Trailer, ...] = ()  # delta-capable plans: one per engine rank written
    delta_bytes: NonNeg = 0  # its delta-out region: payloads and trailers, encoded there
    shadow_bytes: NonNeg = 0  # what it keeps to compare against (the bytes last sent)
    replicas: tuple[ReplicaPart, ...] = ()

    @property
    def write_count(self) -> int:
        return sum(len(b.writes) for b in self.buckets)

    @property
    def write_bytes(self) -> int:
        return sum(w.nbytes for b in self.buckets for w in b.writes)


class Expect(msgspec.Struct, frozen=True, kw_only=True):
    """An engine rank's version is complete after `count` immediates in `slot` (`nbytes`)."""

    rank: NonNeg
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
    count: NonNeg
    nbytes: NonNeg
    sources: tuple[str, ...] = ()  # nodes that write to this rank
    delta_region: int = -1  # its delta area (>= 0: every version is applied and verified)
    trailers: tuple[tuple[NonNeg, NonNeg], ...] = ()  # (offset, capacity) in the delta area
    plan_hash: str = ""  # elastic jobs: its replica's plan (else the node plan's)
    # per trailer (same order): the trainer rank that writes it, and the ranges the plan
    # routes from that rank to this one (what its trailer must say; its payloads' blocks)
    senders: tuple[tuple[str, NonNeg], ...] = ()  # (node, trainer rank)
    planned: tuple[tuple[Range, ...], ...] = ()


class NodePlan(msgspec.Struct, frozen=True, kw_only=True):
    """A daemon's part of the plan: its trainer ranks' work and its engine ranks' counts."""

    plan_hash: str
    job: str
    sends: tuple[RankPlan, ...] = ()
    expects: tuple[Expect, ...] = ()


RING_ALIGN = 256  # slots start at multiples of this; a bucket keeps its offsets mod it


class StagingRing(msgspec.Struct, frozen=True, kw_only=True):
    """Where a rank's buckets are packed when staging is a ring of `slots` slots.

    Bucket b is packed at its planned staging offsets plus `shift[b]`, in ring slot
    `slot[b]`, and may be packed only once every write of bucket `reuse[b]` (the bucket that
    used that slot before it; -1: none) has finished. `slots` = 0 is the whole send: every
    bucket at its planned offsets, `nbytes` = the plan's staging bytes.
    """

    slots: NonNeg
    slot_bytes: NonNeg
    nbytes: NonNeg
    shift: tuple[int, ...]
    slot: tuple[int, ...]
    reuse: tuple[int, ...]


def staging_ring(plan: RankPlan, slots: int) -> StagingRing:
    """The ring of `slots` slots for `plan` (buckets with staged packs take the slots in
    turn), or the whole send when `slots` is 0 or a ring would not be smaller."""
    spans: list[tuple[int, int, int]] = []  # (bucket, base, end) of buckets that stage
    for b in plan.buckets:
        if b.packs:
            lo = min(p.staging_offset for p in b.packs)
            hi = max(p.staging_offset + p.nbytes for p in b.packs)
            spans.append((b.index, lo - lo % RING_ALIGN, hi))
    n = len(plan.buckets)
    slot_bytes = max((hi - lo for _, lo, hi in spans), default=0)
    slot_bytes = -(-slot_bytes // RING_ALIGN) * RING_ALIGN
    if slots <= 0 or slots >= len(spans) or slots * slot_bytes >= plan.staging_bytes:
        return StagingRing(
            slots=0,
            slot_bytes=0,
            nbytes=plan.staging_bytes,
            shift=(0,) * n,
            slot=(-1,) * n,
            reuse=(-1,) * n,
        )
    shift, slot, reuse = [0] * n, [-1] * n, [-1] * n
    for k, (index, lo, _) in enumerate(spans):
        slot[index] = k % slots
        shift[index] = slot[index] * slot_bytes - lo
        reuse[index] = spans[k - slots][0] if k >= slots else -1
    return StagingRing(
        slots=slots,
        slot_bytes=slot_bytes,
        nbytes=slots * slot_bytes,
        shift=tuple(shift),
        slot=tuple(slot),
        reuse=tuple(reuse),
    )
