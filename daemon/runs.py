"""One attempt of a trainer rank at one version (`Run`): what was posted, what landed, the
engine ranks' verdicts, the replicas dropped, and the `PublishResult` that ends it. No I/O."""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.local import PublishResult, ReplicaOutcome, Verdict
from weightwire.protocol.plan import RankPlan, StagingRing
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, Transport

from .packgate import Gated
from .slotfence import Counters

DELTA_OUT = -2  # a write's src_region: the rank's delta-out region (payloads, trailers)
RouteKey = tuple[int, str, int]
"""(source region, destination node, destination region) of a write."""
Route = tuple[Transport, LocalRegion, RegionDescriptor]


@dataclass
class Run:
    """One attempt at one version."""

    version: int
    plan: RankPlan
    staging: LocalRegion | None
    ring: StagingRing
    delta_out: LocalRegion | None = None  # payloads and trailers (src_region DELTA_OUT)
    slot_events: bool = False  # the rank waits for slots on the GPU (`BucketsIssued`)
    issued: int = 0  # buckets reported `BucketsIssued`, or their counters written on the GPU
    counters: Counters | None = None  # the rank waits for slots on the GPU, on these
    gate: Gated | None = None  # buckets posted before packed: their copies wait for this
    on_gpu: set[int] = field(default_factory=set)  # buckets whose counter the GPU writes
    # gated: bucket -> done once its slot's fences are handed over or its post ended
    # (`Poster._handed`: the next bucket of its slot is posted only then)
    handed: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    posted: set[int] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    first_post: float = 0.0
    bucket_posted: dict[int, float] = field(default_factory=dict)  # wall clock
    bucket_landed: dict[int, float] = field(default_factory=dict)
    routes: dict[RouteKey, Route] = field(default_factory=dict)
    bytes_done: int = 0
    writes_done: int = 0
    peer_bytes: dict[str, int] = field(default_factory=dict)  # landed, by destination node
    error: WeightwireError | None = None
    finished: bool = False
    trailers_posted: bool = False
    delta_bytes: int = 0
    verdicts: dict[tuple[str, int], Verdict] = field(default_factory=dict)
    landed: bool = False  # every write landed; a delta-capable plan then awaits the verdicts
    dropped: dict[int, WeightwireError] = field(default_factory=dict)  # elastic: replica -> why
    timeline: dict[str, float] = field(default_factory=dict)
    log_context: contextvars.Context | None = None  # its posts' (rank and version bound)
    """The version's first events, seconds after `started` (`mark`): where start-up goes."""

    def mark(self, event: str, at: float | None = None) -> None:
        """The first time `event` happened in this version (`at`: monotonic, default now)."""
        if event not in self.timeline:
            at = time.monotonic() if at is None else at
            self.timeline[event] = round(at - self.started, 6)

    def replica_nodes(self, replica: int) -> set[str]:
        return {n for p in self.plan.replicas if p.replica == replica for n in p.nodes}

    def all_posted(self) -> bool:
        """Every bucket posted, and the trailers if the plan has any."""
        return len(self.posted) == len(self.plan.buckets) and (
            self.trailers_posted or not self.plan.trailers
        )

    def add_landed(self, nbytes: int, writes: int, by_node: tuple[tuple[str, int], ...]) -> None:
        """Writes of this version that landed: `by_node`, their bytes to each node."""
        self.bytes_done += nbytes
        self.writes_done += writes
        for node, n in by_node:
            self.peer_bytes[node] = self.peer_bytes.get(node, 0) + n

    def outcomes(self) -> tuple[ReplicaOutcome, ...]:
        return tuple(
            ReplicaOutcome(replica=p.replica, ok=True)
            if p.replica not in self.dropped
            else ReplicaOutcome(
                replica=p.replica,
                ok=False,
                code=self.dropped[p.replica].code.value,
                message=self.dropped[p.replica].message,
            )
            for p in self.plan.replicas
        )

    def result(self, now: float, err: WeightwireError | None = None) -> PublishResult:
        """What the rank is told when the version ends at `now` (monotonic): it landed
        (`err` None: with its transfer time and each bucket's posting and landing), or why
        not."""
        landed = err is None
        return PublishResult(
            version=self.version,
            ok=landed,
            nbytes=self.bytes_done,
            writes=self.writes_done,
            seconds=now - self.started,
            code=err.code.value if err else "",
            message=err.message if err else "",
            transfer_seconds=now - self.first_post if landed and self.first_post else 0.0,
            buckets=tuple(
                (self.bucket_posted[b], self.bucket_landed.get(b, 0.0))
                for b in range(len(self.plan.buckets) if landed else 0)
            ),
            verdicts=tuple(self.verdicts.values()),
            delta_bytes=self.delta_bytes,
            replicas=self.outcomes(),
            timeline=self.timeline,
        )


def progress(
    rank: int, plan: RankPlan | None, last_version: int, run: Run | None
) -> dict[str, object]:
    """A publisher's state for `weightwire status`."""
    return {
        "rank": rank,
        "plan": plan.plan_hash if plan else None,
        "last_version": last_version,
        "version": run.version if run else None,
        "state": (
            "idle"
            if run is None
            else "failed"
            if run.error
            else "done"
            if run.finished
            else "writing"
        ),
        "bytes_done": run.bytes_done if run else 0,
        "bytes_total": plan.write_bytes if plan else 0,
        "buckets_posted": len(run.posted) if run else 0,
        "buckets": len(plan.buckets) if plan else 0,
        "staging_buckets": run.ring.slots if run else 0,  # 0: the whole send is staged
        "staging_bytes": run.ring.nbytes if run else 0,
        "slot_events": run.slot_events if run else False,  # slots waited for on the GPU
        "gated": run.gate is not None if run else False,  # buckets posted before packed
        "slot_counters": run.counters is not None if run else False,  # waited for on
        # GPU counters the daemon writes (`buckets_issued`: those written on the GPU)
        "buckets_issued": run.issued if run else 0,  # of them, reported BucketsIssued
    }
