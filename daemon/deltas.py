"""The source side of delta versions, without I/O: a rank's delta payloads and trailers
checked against its plan and turned into writes, and the engine ranks' verdicts as the
version's failure."""

from __future__ import annotations

import msgspec

from weightwire.protocol.errors import ErrorCode, VersionError, WeightwireError
from weightwire.protocol.local import Verdict
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
