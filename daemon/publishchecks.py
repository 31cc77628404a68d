"""What a trainer rank's requests must satisfy before its `Publisher` acts on them: a
version that may begin (its plan current, versions only forwards, its regions registered,
nothing of an earlier one in flight) and buckets that may be posted (of the version
begun, in the plan, each once, in place only where sent whole now)."""

from __future__ import annotations

from collections.abc import Iterable

from weightwire.protocol.errors import ErrorCode, PlanError, VersionError
from weightwire.protocol.plan import RankPlan, StagingRing
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion

from .runs import Run


def check_version(
    plan: RankPlan | None, plan_hash: str, version: int, last_version: int, rank: int
) -> RankPlan:
    """The plan `version` begins on: the rank's current one, the version after its last."""
    if plan is None:
        raise PlanError("this rank has no plan yet", code=ErrorCode.NOT_READY)
    if plan_hash != plan.plan_hash:
        raise PlanError(
            f"publish used plan {plan_hash}, the current plan is {plan.plan_hash}",
            code=ErrorCode.PLAN_CHANGED,
        )
    if version <= last_version:
        raise VersionError(
            f"version {version} does not follow version {last_version} of trainer "
            f"rank {rank}: versions only go forwards"
        )
    return plan


def check_earlier(plan: RankPlan, version: int, earlier: tuple[str, int], rank: int) -> None:
    """A new session of a trainer rank (its process restarted, resumed from a checkpoint)
    publishing on the plan its earlier session used continues after that session's last
    version: the engine ranks hold that version (or have failed it) and would take a
    version number they already settled as one already done (no verdict, a publish that
    waits out its timeout while its bytes overwrite theirs)."""
    plan_hash, last = earlier
    if plan.plan_hash == plan_hash and version <= last:
        raise VersionError(
            f"version {version} of trainer rank {rank}: an earlier session of this rank "
            f"published version {last} on this plan, which the engine ranks hold or "
            f"failed; publish version {last + 1} or later"
        )


def check_served(plan: RankPlan, served: tuple[RegionDescriptor, ...] | None) -> None:
    """The rank holds this plan's regions. The hash does not cover them all: an elastic
    trainer plan's hash is its packs', the same whichever replicas are live, and a plan's
    hash covers region ids and lengths, not keys. A rank that packs in place
    (`client/direct.py`) writes to its own plan's regions, so after a replica joined,
    left or came back it must fetch the plan again (it packed into the old replicas'
    memory only, while the daemon delivered the new one's immediates)."""
    if served is not None and served is not plan.regions and served != plan.regions:
        raise PlanError(
            "the plan's regions changed since this rank fetched it (engine replicas came "
            "or went, or an engine is in new memory): fetch the plan again",
            code=ErrorCode.PLAN_CHANGED,
        )


def check_regions(
    plan: RankPlan,
    ring: StagingRing,
    staging: LocalRegion | None,
    delta_out: LocalRegion | None,
    runs: tuple[Run | None, ...],
) -> None:
    """The staging and delta-out regions `plan` needs are registered, and no write of
    `runs` (earlier versions) is in flight."""
    staging_ok = staging is not None and staging.length >= ring.nbytes
    if ring.nbytes and not staging_ok:
        slots = f" ({ring.slots} slots)" if ring.slots else ""
        raise PlanError(
            f"the plan needs a staging region of {ring.nbytes} bytes{slots}; register one first",
            code=ErrorCode.NOT_READY,
        )
    out_ok = delta_out is not None and delta_out.length >= plan.delta_bytes
    if plan.delta_bytes and not out_ok:
        raise PlanError(
            f"the plan needs a delta-out region of {plan.delta_bytes} bytes; "
            f"register one first (purpose delta)",
            code=ErrorCode.NOT_READY,
        )
    for run in runs:
        if run is not None and run.tasks:
            raise VersionError(
                f"version {run.version} still has writes in flight", code=ErrorCode.NOT_READY
            )


def check_buckets(run: Run | None, version: int, buckets: tuple[int, ...]) -> Run | None:
    """The run `buckets` of `version` are posted in, each bucket in its plan and not
    posted before; None when the version already failed (the rank learns why from
    PublishResult)."""
    if run is not None and version < run.version:
        raise VersionError(
            f"bucket {buckets[0]} of version {version}, older than version {run.version} "
            f"being published"
        )
    if run is None or run.version != version:
        raise VersionError(
            f"bucket {buckets[0]} of version {version}, which was never begun (BeginVersion first)",
            code=ErrorCode.INVALID,
        )
    if run.finished:
        return None
    for bucket in buckets:
        if not 0 <= bucket < len(run.plan.buckets):
            raise VersionError(
                f"bucket {bucket} does not exist (the plan has {len(run.plan.buckets)})",
                code=ErrorCode.INVALID,
            )
    for i, bucket in enumerate(buckets):
        if bucket in run.posted or bucket in buckets[:i]:
            raise VersionError(
                f"bucket {bucket} of version {version} was already posted",
                code=ErrorCode.DUPLICATE,
            )
    return run


def check_in_place(
    buckets: tuple[int, ...], sent: Iterable[int], in_place: tuple[int, ...]
) -> set[int]:
    """The buckets packed in place: all among `buckets`, none sent as a delta payload."""
    direct = set(in_place)
    if not direct <= set(buckets) or direct & set(sent):
        raise VersionError(
            f"buckets {sorted(direct)} said packed in place are not all posted now, or "
            f"also sent as delta payloads",
            code=ErrorCode.INVALID,
        )
    return direct
