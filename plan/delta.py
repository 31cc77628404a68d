"""Delta-capable plans: a pass over the planner's output, for engine ranks with a delta area.

For every engine rank that registered a delta area (purpose "delta"), each trainer rank
that writes to it gets:

- a **trailer** slot in the area (its checksum, ranges and payload list: one more write,
  so the engine's expected immediates grow by one per sender rank), and
- per bucket, a **delta slot**: room for that bucket's payload to that rank, a share of
  the area proportional to the bucket's dense bytes there. A payload that does not fit
  goes dense.

Each sender gets a delta-out region of the same sizes (its payloads and trailers are
encoded there first), and keeps a shadow of its whole send (`RankPlan.shadow_bytes`).
Writes from zero-copy sources always go dense (no shadow to compare with).
The engine rank's `Expect` names, per trailer, its sender rank and the ranges the plan
routes from that rank there (`Expect.planned`): its engine refuses a trailer that claims
others, or a payload into them. The plan hash changes with the delta layout (the ranges
follow from the plan's writes, already hashed).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from weightwire.protocol.errors import PlanError
from weightwire.protocol.plan import (
    DELTA_HEAD,
    DELTA_RANGE,
    Bucket,
    DeltaSlot,
    Expect,
    NodePlan,
    Range,
    RankPlan,
    Trailer,
    WriteOp,
    trailer_capacity,
)
from weightwire.protocol.regions import RegionDescriptor

if TYPE_CHECKING:
    from .compact import PlanSet  # numpy: not at run time (the daemon imports this module)

ALIGN = 64
Dst = tuple[str, int]  # (node, immediate slot) of an engine rank


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _width(writes: list[WriteOp]) -> int:
    """The widest element (up to 2 bytes: bf16/fp16) every block is aligned to."""
    for width in (2,):
        if all(
            w.src_offset % width == 0
            and w.dst_offset % width == 0
            and w.length % width == 0
            and w.src_stride % width == 0
            and w.dst_stride % width == 0
            for w in writes
        ):
            return width
    return 1


class DeltaPlans(Mapping[str, NodePlan]):
    """Node name -> its delta-capable plan (made whole: the pass rewrites every node's)."""

    def __init__(self, plans: dict[str, NodePlan]) -> None:
        self._plans = plans
        self.plan_hash = next(iter(plans.values())).plan_hash if plans else ""
        self.write_count = sum(
            len(b.writes) for p in plans.values() for rp in p.sends for b in rp.buckets
        ) + sum(len(rp.trailers) for p in plans.values() for rp in p.sends)

    def __getitem__(self, node: str) -> NodePlan:
        return self._plans[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)


def _spot(
    dst: Dst,
    spot: tuple[int, int],
    at: int,
    rank_of: Mapping[Dst, int],
    area_of: Mapping[Dst, RegionDescriptor],
) -> dict[str, Any]:
    """A DeltaSpot's fields (a DeltaSlot's or a Trailer's): `spot` (offset, capacity) in the
    delta area of `dst`, encoded at `at` of the rank's delta-out region."""
    return dict(
        dst_node=dst[0],
        dst_rank=rank_of[dst],
        slot=dst[1],
        dst_region=area_of[dst].id,
        dst_offset=spot[0],
        capacity=spot[1],
        src_offset=at,
    )


def add_delta(
    given: PlanSet, areas: Mapping[tuple[str, int], RegionDescriptor]
) -> PlanSet | DeltaPlans:
    """The plans with delta slots and trailers for engine ranks in `areas` ((node, engine
    rank) -> its delta area), or `given` itself when there are none. Raises PlanError when
    an area cannot hold the trailers."""
    if not areas:
        return given
    plans = {node: given[node] for node in given}
    rank_of: dict[Dst, int] = {}
    area_of: dict[Dst, RegionDescriptor] = {}
    for node, np_ in plans.items():
        for e in np_.expects:
            area = areas.get((node, e.rank))
            if area is not None:
                rank_of[(node, e.slot)] = e.rank
                area_of[(node, e.slot)] = area
    if not area_of:
        return DeltaPlans(plans)
    senders = [(node, rp) for node, np_ in sorted(plans.items()) for rp in np_.sends]
    # per destination: (sender key, bucket, write indices) of delta-able writes; and the
    # ranges each sender writes there, in plan order (what its trailer says)
    dense: dict[Dst, list[tuple[tuple[str, int], int, list[int]]]] = defaultdict(list)
    ranges: dict[Dst, dict[tuple[str, int], list[Range]]] = defaultdict(dict)
    for node, rp in senders:
        key = (node, rp.rank)
        for b in rp.buckets:
            by_dst: dict[Dst, list[int]] = defaultdict(list)
            for i, w in enumerate(b.writes):
                dst = (w.dst_node, w.slot)
                if dst not in area_of:
                    continue
                ranges[dst].setdefault(key, []).append(
                    (w.dst_region, w.dst_offset, w.length, w.count, w.dst_stride)
                )
                if w.src_region < 0:
                    by_dst[dst].append(i)
            for dst, idx in by_dst.items():
                dense[dst].append((key, b.index, idx))
    # lay out each area: trailers first, then delta slots proportional to dense bytes
    trailer_at: dict[tuple[Dst, tuple[str, int]], tuple[int, int]] = {}
    slot_at: dict[tuple[Dst, tuple[str, int], int], tuple[int, int]] = {}
    bucket_writes = {
        ((node, rp.rank), b.index): b.writes for node, rp in senders for b in rp.buckets
    }
    for dst, area in area_of.items():
        n_deltas: dict[tuple[str, int], int] = defaultdict(int)
        for key, _, _ in dense[dst]:
            n_deltas[key] += 1
        at = 0
        for key in sorted(ranges[dst]):
            cap = trailer_capacity(len(ranges[dst][key]), n_deltas[key])
            trailer_at[(dst, key)] = (at, cap)
            at = _align(at + cap)
        if at > area.length:
            raise PlanError(
                f"the delta area of engine rank {rank_of[dst]} on {dst[0]} has {area.length} "
                f"bytes; its trailers alone need {at}: register a larger one"
            )
        total = sum(
            sum(bucket_writes[(key, bi)][i].nbytes for i in idx) for key, bi, idx in dense[dst]
        )
        room = area.length - at
        for key, bi, idx in dense[dst]:
            nbytes = sum(bucket_writes[(key, bi)][i].nbytes for i in idx)
            cap = (room * nbytes // total) // ALIGN * ALIGN if total else 0
            floor = DELTA_HEAD + DELTA_RANGE * len(idx) + ALIGN
            if cap >= floor:
                slot_at[(dst, key, bi)] = (at, cap)
                at += cap
    # rewrite the sender plans and the expects
    out: dict[str, NodePlan] = {}
    extra: dict[Dst, int] = defaultdict(int)
    trailers_of: dict[Dst, list[tuple[int, int]]] = defaultdict(list)
    senders_of: dict[Dst, list[tuple[str, int]]] = defaultdict(list)
    planned_of: dict[Dst, list[tuple[Range, ...]]] = defaultdict(list)
    for (dst, key), spot in sorted(trailer_at.items()):
        extra[dst] += 1
        trailers_of[dst].append(spot)
        senders_of[dst].append(key)
        planned_of[dst].append(tuple(ranges[dst][key]))
    sends_of: dict[str, list[RankPlan]] = defaultdict(list)
    for node, rp in senders:
        sends_of[node].append(_rank_plan(node, rp, area_of, rank_of, trailer_at, slot_at))
    layout = msgspec.msgpack.encode(
        [sorted(trailer_at.items()), sorted(slot_at.items()), sorted(area_of.items())]
    )
    for node, np_ in plans.items():
        plan_hash = hashlib.sha256(np_.plan_hash.encode() + layout).hexdigest()[:16]
        expects = tuple(
            _expect(e, area_of.get((node, e.slot)), extra[(node, e.slot)],
                    trailers_of[(node, e.slot)], senders_of[(node, e.slot)],
                    planned_of[(node, e.slot)])
            for e in np_.expects
        )  # fmt: skip
        sends = tuple(
            msgspec.structs.replace(rp, plan_hash=plan_hash) for rp in sends_of.get(node, [])
        )
        out[node] = msgspec.structs.replace(
            np_, plan_hash=plan_hash, sends=sends or np_.sends, expects=expects
        )
    return DeltaPlans(out)


def _expect(
    e: Expect,
    area: RegionDescriptor | None,
    extra: int,
    trailers: list[tuple[int, int]],
    senders: list[tuple[str, int]],
    planned: list[tuple[Range, ...]],
) -> Expect:
    if area is None:
        return e
    return msgspec.structs.replace(
        e,
        count=e.count + extra,
        delta_region=area.id,
        trailers=tuple(trailers),
        senders=tuple(senders),
        planned=tuple(planned),
    )


def _rank_plan(
    node: str,
    rp: RankPlan,
    area_of: Mapping[Dst, RegionDescriptor],
    rank_of: Mapping[Dst, int],
    trailer_at: Mapping[tuple[Dst, tuple[str, int]], tuple[int, int]],
    slot_at: Mapping[tuple[Dst, tuple[str, int], int], tuple[int, int]],
) -> RankPlan:
    key = (node, rp.rank)
    at = 0  # in the rank's delta-out region
    buckets = []
    for b in rp.buckets:
        by_dst: dict[Dst, list[int]] = defaultdict(list)
        for i, w in enumerate(b.writes):
            if w.src_region < 0 and (w.dst_node, w.slot) in area_of:
                by_dst[(w.dst_node, w.slot)].append(i)
        deltas = []
        for dst, idx in sorted(by_dst.items()):
            spot = slot_at.get((dst, key, b.index))
            if spot is None:
                continue
            deltas.append(
                DeltaSlot(
                    **_spot(dst, spot, at, rank_of, area_of),
                    writes=tuple(idx),
                    width=_width([b.writes[i] for i in idx]),
                )
            )
            at = _align(at + spot[1])
        buckets.append(msgspec.structs.replace(b, deltas=tuple(deltas)) if deltas else b)
    trailers = []
    for (dst, k), spot in sorted(trailer_at.items()):
        if k != key:
            continue
        trailers.append(Trailer(**_spot(dst, spot, at, rank_of, area_of)))
        at = _align(at + spot[1])
    if not trailers:
        return rp
    regions = {(r.node, r.id): r for r in rp.regions}
    for dst in {(t.dst_node, t.slot) for t in trailers}:
        regions[(dst[0], area_of[dst].id)] = area_of[dst]
    return msgspec.structs.replace(
        rp,
        buckets=tuple(buckets),
        trailers=tuple(trailers),
        delta_bytes=at,
        shadow_bytes=rp.staging_bytes,
        regions=tuple(regions.values()),
    )


def trailer_ranges(rp: RankPlan, t: Trailer) -> list[Range]:
    """(region, offset, length, count, stride) of every write of `rp` to `t`'s engine rank,
    in plan order: what the trailer's checksum covers."""
    return [
        (w.dst_region, w.dst_offset, w.length, w.count, w.dst_stride)
        for b in rp.buckets
        for w in b.writes
        if (w.dst_node, w.slot) == (t.dst_node, t.slot)
    ]


def bucket_shadow(b: Bucket) -> int:
    return sum(w.nbytes for w in b.writes if w.src_region < 0)
