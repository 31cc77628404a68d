"""The source side of delta versions, without I/O: a rank's delta payloads and trailers
checked against its plan and turned into writes, and the engine ranks' verdicts as the
version's failure."""

from __future__ import annotations

import msgspec

from weightwire.protocol.errors import ErrorCode, VersionError, WeightwireError
from weightwire.protocol.local import Verdict
from weightwire.protocol.peer import LandedPart
from weightwire.protocol.plan import Bucket, DeltaSlot, RankPlan, Trailer, WriteOp

from .runs import DELTA_OUT


def check_payloads(
    plan: RankPlan, buckets: tuple[int, ...], delta: tuple[tuple[int, int, int], ...]
) -> dict[int, dict[int, int]]:
    """bucket -> {delta slot: payload bytes}, from (bucket, delta slot, payload bytes) of
    the buckets `buckets` posted now, checked against the plan."""
    sent: dict[int, dict[int, int]] = {}
    for bucket, index, nbytes in delta:
        if bucket not in buckets or not 0 <= index < len(plan.buckets[bucket].deltas):
            raise VersionError(
                f"delta payload for slot {index} of bucket {bucket}, which the plan does "
                f"not have or which is not posted now",
                code=ErrorCode.INVALID,
            )
        ds = plan.buckets[bucket].deltas[index]
        if not len(ds.writes) <= nbytes <= ds.capacity or index in sent.get(bucket, {}):
            raise VersionError(
                f"delta payload of {nbytes} bytes for slot {index} of bucket {bucket} "
                f"(room {ds.capacity}, at least {len(ds.writes)}), or given twice",
                code=ErrorCode.INVALID,
            )
        sent.setdefault(bucket, {})[index] = nbytes
    return sent


def bucket_writes(b: Bucket, sent: dict[int, int], shift: int) -> tuple[list[WriteOp], int]:
    """A bucket some of whose destinations get a delta payload (`sent`: delta slot ->
    payload bytes), and the payloads' bytes: each payload travels as many writes
    (consecutive parts of it) as the dense writes it replaces, into that engine's delta
    area; the other writes go as planned, from the bucket's ring slot (`shift`)."""
    replaced: set[int] = set()
    writes: list[WriteOp] = []
    for index, nbytes in sorted(sent.items()):
        ds = b.deltas[index]
        replaced.update(ds.writes)
        writes += _payload_writes(ds, nbytes)
    writes += [
        msgspec.structs.replace(w, src_offset=w.src_offset + shift) if w.src_region == -1 else w
        for i, w in enumerate(b.writes)
        if i not in replaced
    ]
    return writes, sum(sent.values())


def _payload_writes(ds: DeltaSlot, nbytes: int) -> list[WriteOp]:
    """A payload of `nbytes` at `ds.src_offset` as len(ds.writes) consecutive parts."""
    k = len(ds.writes)
    cuts = [nbytes * i // k for i in range(k + 1)]
    return [
        WriteOp(
            src_offset=ds.src_offset + cuts[i],
            src_region=DELTA_OUT,
            length=cuts[i + 1] - cuts[i],
            dst_node=ds.dst_node,
            dst_region=ds.dst_region,
            dst_offset=ds.dst_offset + cuts[i],
            slot=ds.slot,
            dst_rank=ds.dst_rank,
        )
        for i in range(k)
    ]


def trailer_writes(trailers: tuple[Trailer, ...], lengths: tuple[int, ...]) -> list[WriteOp]:
    """The rank's trailers (`lengths` bytes each, one per trailer of the plan, in its
    order) as writes."""
    for t, n in zip(trailers, lengths, strict=True):
        if not 0 < n <= t.capacity:
            raise VersionError(
                f"a trailer of {n} bytes for a slot of {t.capacity}", code=ErrorCode.INVALID
            )
    return [
        WriteOp(
            src_offset=t.src_offset,
            src_region=DELTA_OUT,
            length=n,
            dst_node=t.dst_node,
            dst_region=t.dst_region,
            dst_offset=t.dst_offset,
            slot=t.slot,
            dst_rank=t.dst_rank,
        )
        for t, n in zip(trailers, lengths, strict=True)
    ]


def expects(plan: RankPlan, verdict: Verdict) -> bool:
    """The verdict is from an engine rank this plan sends a trailer to."""
    return any((t.dst_node, t.slot) == (verdict.node, verdict.slot) for t in plan.trailers)


def refused(verdicts: dict[tuple[str, int], Verdict]) -> WeightwireError | None:
    """The version's failure when an engine rank failed it (each such rank named)."""
    bad = [v for v in verdicts.values() if not v.ok]
    if not bad:
        return None
    return WeightwireError(
        "; ".join(f"engine rank {v.rank} on {v.node}: {v.message}" for v in bad),
        code=_code(bad[0].code),
    )


def _code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.TRANSFER


Ranges = dict[tuple[str, int], tuple[tuple[int, int, int, int, int], ...]]


def _bucket_ranges(plan: RankPlan, b: Bucket) -> Ranges:
    """(engine node, slot) -> the ranges bucket `b` writes there that a trailer covers,
    in the order the rank's checksum takes them (`DeltaSender`: the bucket's writes)."""
    dsts = {(t.dst_node, t.slot) for t in plan.trailers}
    out: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = {}
    for w in b.writes:
        if (w.dst_node, w.slot) in dsts:
            r = (w.dst_region, w.dst_offset, w.length, w.count, w.dst_stride)
            out.setdefault((w.dst_node, w.slot), []).append(r)
    return {k: tuple(v) for k, v in out.items()}


class LandedNotes:
    """What a landed bucket tells its engine nodes (`BucketLanded`): per engine rank, the
    ranges it wrote there and its delta payloads; the ranges kept per plan."""

    def __init__(self) -> None:
        self._plan = ""
        self._ranges: dict[int, Ranges] = {}

    def parts(
        self, plan: RankPlan, bucket: int, sent: dict[int, int]
    ) -> dict[str, tuple[LandedPart, ...]]:
        """node -> its parts, for a delta-capable plan (none otherwise)."""
        if not plan.trailers:
            return {}
        if plan.plan_hash != self._plan:
            self._plan, self._ranges = plan.plan_hash, {}
        b = plan.buckets[bucket]
        ranges = self._ranges.get(bucket)
        if ranges is None:
            ranges = self._ranges[bucket] = _bucket_ranges(plan, b)
        payloads: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for index, nbytes in sorted(sent.items()):
            ds = b.deltas[index]
            payloads.setdefault((ds.dst_node, ds.slot), []).append((ds.dst_offset, nbytes))
        out: dict[str, list[LandedPart]] = {}
        for key in sorted(set(ranges) | set(payloads)):
            part = LandedPart(
                slot=key[1], ranges=ranges.get(key, ()), payloads=tuple(payloads.get(key, ()))
            )
            out.setdefault(key[0], []).append(part)
        return {node: tuple(ps) for node, ps in out.items()}
