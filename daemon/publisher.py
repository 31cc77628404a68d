"""The source side: one trainer rank's versions, bucket by bucket, each on its own.

A rank's publish never waits for another rank. Bucket b's writes are posted the
moment the rank says it is packed; the rank is told when every write of the version
has landed, or the first cause of failure. A rank that packs into a ring of staging slots
is also told as each bucket's writes have all finished (its slot is free again).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    TransferError,
    VersionError,
    WeightwireError,
)
from weightwire.protocol.local import Verdict
from weightwire.protocol.peer import LandedPart
from weightwire.protocol.plan import RankPlan, StagingRing
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion

from . import deltas, packgate
from .metrics import Recorder
from .packgate import MakeGate, PackGate
from .posting import Poster
from .prepared import PreparedWrites, SourceRegion
from .publishchecks import (
    check_buckets,
    check_earlier,
    check_in_place,
    check_regions,
    check_served,
    check_version,
)
from .ringslots import Reply, RingSlots
from .runs import Run, progress
from .seams import PickTransport
from .slotfence import MakeCounters, SlotCounters
from .versionend import VersionEnd

log = structlog.get_logger("weightwire.daemon.publisher")

TellLanded = Callable[[str, int, int, tuple[LandedPart, ...]], None]
"""tell_landed(engine node, version, bucket, its parts there)."""


@dataclass
class Publisher:
    """One trainer rank's versions: their checks and life cycle (begin, buckets and
    trailers posted, verdicts, landed or failed), the posting itself done by a `Poster`
    over the rank's `PreparedWrites`, a version's end (answer, log line, metrics) told by
    a `VersionEnd`."""

    job: str
    rank: int
    pick: PickTransport
    reply: Reply
    announce: Callable[[int, str, str, set[str]], None]
    """announce(version, "start"|"abort", message, destination nodes)."""
    source_region: SourceRegion
    metrics: Recorder | None = None
    """Told of each landed bucket and each finished version (never per write)."""
    plan: RankPlan | None = None
    served: tuple[RegionDescriptor, ...] | None = None
    """The regions of the plan the rank was last given (GetPlan): a version begun on a plan
    of the same hash with other regions is refused (`check_served`)."""
    staging: LocalRegion | None = None
    delta_out: LocalRegion | None = None  # where the rank encodes payloads and trailers
    last_version: int = -1
    earlier: tuple[str, int] = ("", -1)
    """(plan hash, last version begun) of the rank's earlier session on this node: a new
    session (a trainer process restarted) on the same plan continues after that version."""
    run: Run | None = None
    previous: Run | None = None  # the last run of an earlier session of this rank
    prepared: PreparedWrites = field(init=False)
    _poster: Poster = field(init=False)
    make_counters: MakeCounters = SlotCounters  # a version's GPU slot counters
    make_gate: MakeGate = PackGate  # a version's pack counter
    tell_landed: TellLanded | None = None
    """Delta-capable plans: a landed bucket's engine nodes are told (`BucketLanded`)."""
    _notes: deltas.LandedNotes = field(init=False)
    _end: VersionEnd = field(init=False)

    def __post_init__(self) -> None:
        self.prepared = PreparedWrites(self.pick, self.source_region)
        slots = RingSlots(self.job, self.rank, self.reply, self._fail)
        self._notes = deltas.LandedNotes()
        # the rank's `reply` as it is when a version ends (a test sets it after construction)
        self._end = VersionEnd(self.job, self.rank, lambda r: self.reply(r), self.metrics)
        self._poster = Poster(
            self.job, self.rank, self.prepared, slots, self._drop, self.metrics, self._landed
        )

    def _landed(self, run: Run, bucket: int, sent: dict[int, int]) -> None:
        """Bucket `bucket` landed everywhere: its engine ranks may apply and checksum it
        now, off the version's tail (not those of a dropped replica: nothing says its
        writes landed)."""
        if self.tell_landed is None or not run.plan.trailers:
            return
        dropped = {n for r in run.dropped for n in run.replica_nodes(r)}
        for node, parts in self._notes.parts(run.plan, bucket, sent).items():
            if node not in dropped:
                self.tell_landed(node, run.version, bucket, parts)

    def set_plan(
        self, plan: RankPlan | None, reason: str = "", code: ErrorCode = ErrorCode.PLAN_CHANGED
    ) -> None:
        """A new plan, or None: the plan was withdrawn (`code` PEER_LOST: a node it involves
        was lost, and a version in flight fails with that, as any lost peer's does)."""
        running = self.run is not None and not self.run.finished
        new_hash = plan.plan_hash if plan is not None else None
        old = self.plan
        if (
            plan is not None
            and old is not None
            and plan.replicas
            and old.replicas
            and new_hash == old.plan_hash
        ):
            self._replicas_changed(plan)
            return
        if running and self.plan is not None and new_hash != self.plan.plan_hash:
            why = reason or "the plan changed mid-version"
            self._fail(WeightwireError(why, code=code))
        self.plan = plan
        self.prepared.use(plan)

    def _replicas_changed(self, plan: RankPlan) -> None:
        """Elastic: the same packs, engine replicas gone or come. A running version keeps
        its own plan (a replica that joins gets the next version) and drops the replicas
        that left; what was prepared for the replicas that stay is kept."""
        live = {p.plan_hash for p in plan.replicas}
        run = self.run
        if run is not None and not run.finished:
            for p in run.plan.replicas:
                if p.plan_hash not in live:
                    self._drop(
                        run,
                        p.replica,
                        PeerLostError(f"engine replica {p.replica} left the plan mid-version"),
                    )
        self.plan = plan
        self.prepared.keep(plan, live)

    def drop_nodes(self, nodes: set[str], reason: str) -> bool:
        """Elastic: nodes of engine replicas were lost. The running version drops those
        replicas (the others go on); False when the plan is not elastic."""
        if self.plan is None or not self.plan.replicas:
            return False
        run = self.run
        if run is not None and not run.finished:
            for p in run.plan.replicas:
                if nodes & set(p.nodes):
                    self._drop(run, p.replica, PeerLostError(reason))
        return True

    def _drop(self, run: Run, replica: int, err: WeightwireError) -> None:
        """Engine replica `replica` gets no more of `run`'s version; the others go on. When
        none is left the version fails."""
        if run.finished or replica in run.dropped:
            return
        run.dropped[replica] = err
        log.warning(
            "replica dropped from version",
            rank=self.rank,
            version=run.version,
            replica=replica,
            code=err.code.value,
            error=err.message,
        )
        nodes = run.replica_nodes(replica)
        self.announce(run.version, "abort", f"[{err.code.value}] {err.message}", nodes)
        if all(p.replica in run.dropped for p in run.plan.replicas):
            self._fail(err, run)
        elif not run.tasks:
            run.landed = run.all_posted()
            self._maybe_finish(run)

    def ring(self, slots: int) -> StagingRing:
        """The plan's staging ring of `slots` slots (0: the whole send)."""
        assert self.plan is not None
        return self.prepared.ring(self.plan, slots)

    @property
    def destinations(self) -> set[str]:
        return {r.node for r in self.plan.regions} if self.plan else set()

    def begin(
        self,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence_offset: int = -1,
        fence_base: int = 0,
        gate_offset: int = -1,
        *,
        announce: bool = True,
    ) -> None:
        """`fence_offset` >= 0: the rank waits for ring slots on the GPU, on counters at
        that offset of its staging region (`BeginVersion.fence_offset`). `gate_offset`
        >= 0: the rank posts buckets before they are packed, its pack counter there
        (`BeginVersion.gate_offset`, `daemon/packgate.py`). `announce` False: the caller
        answers the rank first, then calls `started` (the version's announce is a send to
        each destination node, off the BeginVersion's round trip)."""
        plan = check_version(self.plan, plan_hash, version, self.last_version, self.rank)
        check_earlier(plan, version, self.earlier, self.rank)
        check_served(plan, self.served)
        ring = self.ring(staging_buckets)
        check_regions(plan, ring, self.staging, self.delta_out, (self.previous, self.run))
        counters = None
        if fence_offset >= 0:
            counters = self.make_counters(
                self.staging, ring, fence_offset, fence_base, len(plan.buckets)
            )
        gate = None
        if gate_offset >= 0:
            fence = (fence_offset, ring.slots if counters is not None else 0)
            packgate.check_plan(plan)
            gate = self.make_gate(
                self.staging, ring, gate_offset, fence_base, len(plan.buckets), fence
            )
        self.last_version = version
        self.run = Run(
            version=version,
            plan=plan,
            staging=self.staging,
            ring=ring,
            delta_out=self.delta_out,
            slot_events=slot_events and ring.slots > 0 and counters is None,
            counters=counters,
            gate=gate,
        )
        if announce:
            self.started()

    def started(self) -> None:
        """The version just begun, announced to its destinations (and finished at once when
        the plan sends nothing)."""
        run = self.run
        assert run is not None and self.plan is not None
        self.announce(run.version, "start", "", self.destinations)
        if not self.plan.buckets and not self.plan.trailers:
            self._end.finish(run)

    def bucket_ready(
        self,
        version: int,
        buckets: tuple[int, ...],
        delta: tuple[tuple[int, int, int], ...] = (),
        in_place: tuple[int, ...] = (),
    ) -> bool:
        """Buckets of `version` packed by the rank: their writes are posted together.
        True when nothing of the version was being posted (the caller lets this post start
        before it reads more).
        `delta`: (bucket, delta slot, payload bytes) of those sent as delta payloads.
        `in_place`: those the rank packed straight into their destinations (colocated):
        only their immediates are delivered (`Poster._post_in_place`)."""
        run = check_buckets(self.run, version, buckets)
        if run is None:
            return False  # the version already failed; the rank learns why from PublishResult
        if run.gate is not None:
            packgate.check_order(version, buckets, run.posted)
        sent = deltas.check_payloads(run.plan, buckets, delta)
        direct = check_in_place(buckets, sent, in_place)
        run.posted.update(buckets)
        if not run.first_post:
            run.first_post = time.monotonic()
            run.mark("first_ready", run.first_post)
        now = time.time()
        for bucket in buckets:
            run.bucket_posted[bucket] = now
        if run.log_context is None:  # the posts' log lines name the rank and version:
            run.log_context = contextvars.copy_context()  # bound once per version
            run.log_context.run(
                structlog.contextvars.bind_contextvars,
                role="trainer",
                rank=self.rank,
                job=self.job,
                version=version,
            )
        task = asyncio.get_running_loop().create_task(
            self._poster.post(run, buckets, sent, direct), context=run.log_context.copy()
        )
        idle = not run.tasks
        run.tasks.add(task)
        task.add_done_callback(functools.partial(self._written, run))
        return idle

    def trailers_ready(self, version: int, lengths: tuple[int, ...]) -> None:
        """The rank's trailers of `version` are in staging: post them (its last writes)."""
        run = self.run
        if run is None or run.version != version:
            raise VersionError(f"trailers of version {version}, which was not begun")
        if run.finished:
            return
        trailers = run.plan.trailers
        if run.trailers_posted or len(lengths) != len(trailers):
            raise VersionError(
                f"{len(lengths)} trailers for a plan with {len(trailers)}, or posted twice",
                code=ErrorCode.INVALID,
            )
        writes = deltas.trailer_writes(trailers, lengths)
        run.trailers_posted = True
        run.delta_bytes += sum(lengths)
        task = asyncio.get_running_loop().create_task(self._poster.post_writes(run, writes))
        run.tasks.add(task)
        task.add_done_callback(functools.partial(self._written, run))

    def on_verdict(self, version: int, verdict: Verdict) -> None:
        """An engine rank's outcome of `version` (delta-capable plans)."""
        run = self.run
        if run is None or run.version != version or run.finished:
            return
        if not deltas.expects(run.plan, verdict):
            return
        run.verdicts[(verdict.node, verdict.slot)] = verdict
        self._maybe_finish(run)

    def _maybe_finish(self, run: Run) -> None:
        """Finish once every write landed and every engine rank gave its verdict; fail as
        soon as one failed the version and no write of it is in flight."""
        if run.finished or run.tasks:
            return
        err = deltas.refused(run.verdicts)
        if err is not None:
            self._fail(err, run, announce=False)
        elif run.landed and len(run.verdicts) >= len(run.plan.trailers):
            self._end.finish(run)

    def _written(self, run: Run, task: asyncio.Task[None]) -> None:
        run.tasks.discard(task)
        if task.cancelled():
            exc: BaseException | None = WeightwireError("write cancelled", code=ErrorCode.ABORTED)
        else:
            exc = task.exception()
        if exc is not None and not run.finished:
            err = exc if isinstance(exc, WeightwireError) else TransferError(repr(exc))
            self._fail(err, run)
        elif not run.finished and not run.tasks:
            run.landed = run.all_posted()
            self._maybe_finish(run)

    def abort(self, reason: str, code: ErrorCode = ErrorCode.ABORTED) -> None:
        self._fail(WeightwireError(reason, code=code))

    def _fail(self, err: WeightwireError, run: Run | None = None, *, announce: bool = True) -> None:
        """`announce`: tell the destinations to fail the version (not when they are the
        ones that failed it)."""
        run = run or self.run
        if run is None or run.finished:
            return
        ended = run

        def tell(message: str) -> None:
            self.announce(ended.version, "abort", message, self.destinations)

        self._end.fail(run, err, tell if announce else None)

    def settled(self) -> bool:
        """No write of an earlier version (this session's or an earlier one's) is in
        flight: a version may begin now, with nothing to `drain`."""
        if any(run is not None and run.tasks for run in (self.previous, self.run)):
            return False
        self.previous = None
        return True

    async def drain(self, timeout_s: float) -> None:
        """Wait for writes still in flight: a failed version's stragglers, or those of an
        earlier session of this rank, which must never land on top of a newer version."""
        tasks = set()
        for run in (self.previous, self.run):
            if run is not None:
                tasks |= run.tasks
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)  # returns at the timeout, no raise
        if self.previous is not None and not self.previous.tasks:
            self.previous = None

    def progress(self) -> dict[str, object]:
        return progress(self.rank, self.plan, self.last_version, self.run)
