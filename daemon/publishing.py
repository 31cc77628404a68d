"""The trainer ranks of this node: one `Publisher` per rank, and what it needs from the
rest of the daemon (a transport, its rank's socket, the peers it writes to), handed to it
as narrow seams rather than callbacks into the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from weightwire.memory.cudadrv import CudaError
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import BucketsIssued, BucketsLanded, PublishResult, Verdict
from weightwire.protocol.peer import (
    BucketLanded,
    LandedPart,
    PeerMsg,
    VersionAbort,
    VersionStart,
)
from weightwire.protocol.plan import NodePlan
from weightwire.transport.base import LocalRegion

from .metrics import Recorder
from .packgate import WAIT_S
from .publisher import Publisher
from .regions import RegionRegistry
from .runs import Run
from .seams import PeerSend, PickTransport, RankLink
from .sessions import Session
from .slotfence import Counters

EARLIER = 4096
"""Gone trainer ranks whose last version is remembered (a new session of the rank on the
same plan continues after it), the oldest forgotten first."""

log = structlog.get_logger("weightwire.daemon")


@dataclass(frozen=True)
class _RankOutbox:
    """A trainer rank's end of its publisher: results to its session, version starts and
    aborts to the nodes it writes to."""

    node: str
    session: Session
    link: RankLink
    mesh: PeerSend
    registry: RegionRegistry

    def reply(self, result: PublishResult | BucketsLanded | BucketsIssued) -> None:
        self.link.send(self.session.identity, result)

    def announce(self, version: int, kind: str, message: str, nodes: set[str]) -> None:
        s = self.session
        msg: PeerMsg
        if kind == "start":
            msg = VersionStart(
                job=s.job, version=version, source_node=self.node, source_rank=s.rank
            )
        else:
            msg = VersionAbort(
                job=s.job,
                version=version,
                source_node=self.node,
                source_rank=s.rank,
                code=ErrorCode.ABORTED.value,
                message=message,
            )
        for node in nodes:
            self.mesh.send_soon(node, msg)

    def landed(self, node: str, version: int, bucket: int, parts: tuple[LandedPart, ...]) -> None:
        s = self.session
        msg = BucketLanded(
            job=s.job,
            version=version,
            source_node=self.node,
            source_rank=s.rank,
            bucket=bucket,
            parts=parts,
        )
        self.mesh.send_soon(node, msg)

    def own_region(self, region_id: int) -> LocalRegion:
        region = self.registry.regions.get(region_id)
        if region is None or region.session != self.session.id:
            raise WeightwireError(
                f"region {region_id} is not registered by trainer rank {self.session.rank}",
                code=ErrorCode.UNKNOWN_REGION,
            )
        return region.local


class Publishing:
    """Owns the publishers of this node's trainer ranks (implements `PlanUser`)."""

    def __init__(
        self,
        node: str,
        pick: PickTransport,
        link: RankLink,
        mesh: PeerSend,
        registry: RegionRegistry,
        plans: Mapping[str, NodePlan],
        metrics: Recorder | None = None,
    ) -> None:
        self.node = node
        self._pick = pick
        self._link = link
        self._mesh = mesh
        self._registry = registry
        self._plans = plans  # as installed (PlanBook owns them)
        self._metrics = metrics
        self.publishers: dict[tuple[str, int], Publisher] = {}
        self._detached: dict[tuple[str, int], Run] = {}  # runs of gone sessions still writing
        # (plan hash, last version begun) of each trainer rank's last session that is gone
        self._earlier: dict[tuple[str, int], tuple[str, int]] = {}

    def publisher(self, session: Session) -> Publisher:
        if session.role != "trainer":
            raise WeightwireError(
                f"a {session.role} session cannot publish", code=ErrorCode.INVALID
            )
        key = (session.job, session.rank)
        pub = self.publishers.get(key)
        if pub is None:
            out = _RankOutbox(self.node, session, self._link, self._mesh, self._registry)
            pub = Publisher(
                job=session.job,
                rank=session.rank,
                pick=self._pick,
                reply=out.reply,
                announce=out.announce,
                tell_landed=out.landed,
                source_region=out.own_region,
                metrics=self._metrics,
            )
            pub.previous = self._detached.pop(key, None)
            pub.earlier = self._earlier.pop(key, pub.earlier)
            self.publishers[key] = pub
            plan = self._plans.get(session.job)
            rp = next((s for s in plan.sends if s.rank == session.rank), None) if plan else None
            if rp is not None:
                pub.set_plan(rp)
        return pub

    def use_plan(self, job: str, plan: NodePlan | None, reason: str = "") -> None:
        if plan is None:
            for pub in self._of_job(job):
                pub.set_plan(None, reason, ErrorCode.PEER_LOST)
            return
        for rp in plan.sends:
            if (mine := self.publishers.get((job, rp.rank))) is not None:
                mine.set_plan(rp)

    def plan_problem(self, job: str, err: WeightwireError) -> None:
        """The job cannot be planned: its ranks' plan goes, a version in flight fails with
        the problem; their next version asks for a plan and hears it."""
        for pub in self._of_job(job):
            pub.set_plan(None, err.message, err.code)

    def _of_job(self, job: str) -> list[Publisher]:
        return [pub for (j, _), pub in self.publishers.items() if j == job]

    def on_verdict(self, job: str, version: int, verdict: Verdict) -> None:
        for pub in self._of_job(job):
            pub.on_verdict(version, verdict)

    def drop_nodes(self, job: str, nodes: set[str], reason: str) -> None:
        """An elastic job's engine replicas on `nodes` are gone from the version in flight."""
        for pub in self._of_job(job):
            pub.drop_nodes(nodes, reason)

    def session_gone(self, session: Session) -> Awaitable[None] | None:
        """The rank's version in flight fails. Returns what to wait for before its regions
        are unmapped, where the GPU may still use its staging: the copies released from
        its pack counter by the failure just now, and its slot counters' writes behind
        them. None: unmap now."""
        gone = self.publishers.pop((session.job, session.rank), None)
        if gone is None:
            return None
        if gone.plan is not None and gone.last_version >= 0:
            self._earlier[(session.job, session.rank)] = (gone.plan.plan_hash, gone.last_version)
            while len(self._earlier) > EARLIER:
                del self._earlier[next(iter(self._earlier))]
        run, counters = gone.run, gone.run.counters if gone.run is not None else None
        if run is not None:  # nothing waits on its slot counters any more, and its
            run.counters = None  # staging is unmapped next: no release write there
        gone.abort(f"trainer rank {session.rank} disconnected mid-version")
        if run is None or not run.tasks:
            return None
        self._detached[(session.job, session.rank)] = run
        if run.gate is None:
            return None
        return _settled(set(run.tasks), counters)

    def abort_all(self, reason: str, code: ErrorCode) -> None:
        for pub in self.publishers.values():
            pub.abort(reason, code)

    def busy(self) -> int:
        return sum(1 for p in self.publishers.values() if p.run and not p.run.finished)

    def progress(self) -> list[dict[str, Any]]:
        return [{"job": job, **pub.progress()} for (job, _), pub in sorted(self.publishers.items())]


async def _settled(tasks: set[asyncio.Task[None]], counters: Counters | None) -> None:
    """Until a gone rank's writes are done and its slot counters written (bounded)."""
    await asyncio.wait(tasks, timeout=WAIT_S)
    if counters is not None:
        try:
            await counters.settled(WAIT_S)
        except CudaError as exc:
            log.warning("slot counter writes not awaited", error=exc.message)
