"""What the ranks of this host ask of the daemon: publishing, plans, waiting for versions,
and what a rank leaves behind when it goes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import structlog

from weightwire.protocol.errors import ErrorCode, PlanError, WeightwireError
from weightwire.protocol.local import (
    Applied,
    ApplyVersion,
    Ok,
    PlanReply,
    StatusReply,
    Verdict,
    VersionComplete,
    VersionFailed,
)
from weightwire.protocol.peer import (
    PeerMsg,
    VersionAbort,
    VersionStart,
    VersionVerdict,
)
from weightwire.protocol.plan import RankPlan
from weightwire.transport.base import LocalRegion

from .completion import RankCompletion
from .publisher import Publisher
from .regions import Region
from .sessions import Session

log = structlog.get_logger("weightwire.daemon")


class RankService:
    """Served to the local socket's sessions (mixed into Daemon)."""

    def publisher(self, session: Session) -> Publisher:
        if session.role != "trainer":
            raise WeightwireError(
                f"a {session.role} session cannot publish", code=ErrorCode.INVALID
            )
        key = (session.job, session.rank)
        pub = self.publishers.get(key)
        if pub is None:
            pub = Publisher(
                job=session.job,
                rank=session.rank,
                pick=self.transport_to,
                reply=lambda result, s=session: self.local.send(s.identity, result),
                announce=lambda v, kind, m, nodes, s=session: self._announce(s, v, kind, m, nodes),
                source_region=lambda rid, s=session: self._own_region(s, rid),
                metrics=self.metrics,
            )
            pub.previous = self.detached.pop(key, None)
            self.publishers[key] = pub
            rp = self._rank_plan(session.job, session.rank)
            if rp is not None:
                pub.set_plan(rp)
        return pub

    def _announce(
        self, session: Session, version: int, kind: str, message: str, nodes: set[str]
    ) -> None:
        msg: PeerMsg
        if kind == "start":
            msg = VersionStart(
                job=session.job, version=version, source_node=self.node, source_rank=session.rank
            )
        else:
            msg = VersionAbort(
                job=session.job,
                version=version,
                source_node=self.node,
                source_rank=session.rank,
                code=ErrorCode.ABORTED.value,
                message=message,
            )
        for node in nodes:
            self.mesh.send_soon(node, msg)

    def _own_region(self, session: Session, region_id: int) -> LocalRegion:
        region = self.registry.regions.get(region_id)
        if region is None or region.session != session.id:
            raise WeightwireError(
                f"region {region_id} is not registered by trainer rank {session.rank}",
                code=ErrorCode.UNKNOWN_REGION,
            )
        return region.local

    def region_added(self, session: Session, region: Region) -> None:
        if session.role == "trainer" and region.purpose == "staging":
            self.publisher(session).staging = region.local
        elif session.role == "trainer" and region.purpose == "delta":
            self.publisher(session).delta_out = region.local
        elif session.role == "engine" and session.destinations:
            self.advertise(session.job)
        self.grant_writers()

    async def plan_for(self, session: Session, req: int, timeout_s: float) -> PlanReply:
        if session.role != "trainer":
            raise WeightwireError(
                f"a {session.role} session has no send plan", code=ErrorCode.INVALID
            )
        if not session.sources:
            raise PlanError("declare this rank's tensors before asking for its plan")
        deadline = time.monotonic() + timeout_s
        while True:
            if session.job in self.plan_problems:
                raise self.plan_problems[session.job]
            rp = self._rank_plan(session.job, session.rank)
            if rp is not None:
                self.publisher(session)
                return PlanReply(req=req, plan=rp)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanError(self._waiting_for(session.job), code=ErrorCode.NOT_READY)
            await self._plan_changed(session.job, left)

    def _rank_plan(self, job: str, rank: int) -> RankPlan | None:
        plan = self.plans.get(job)
        return next((s for s in plan.sends if s.rank == rank), None) if plan else None

    async def _plan_changed(self, job: str, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the job's plan to be installed or withdrawn."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.plan_waiters.setdefault(job, []).append(fut)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fut, timeout_s)

    def _waiting_for(self, job: str) -> str:
        if self.coordinator_name is None:
            return f"no plan for job {job!r}: not joined to the coordinator yet"
        if self.coordinator is not None:
            return f"no plan for job {job!r} yet; waiting for {self.coordinator.missing(job)}"
        return f"no plan for job {job!r} yet: the coordinator is waiting for more ranks"

    async def begin_version(
        self,
        session: Session,
        req: int,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
    ) -> Any:
        pub = self.publisher(session)
        await pub.drain(self.cfg.stall_timeout_s)
        pub.begin(version, plan_hash, staging_buckets, slot_events)
        return Ok(req=req, detail=f"version {version}")

    async def wait_version(
        self, session: Session, req: int, version: int, timeout_s: float
    ) -> VersionComplete:
        if session.role != "engine":
            raise WeightwireError(
                f"a {session.role} session does not receive versions", code=ErrorCode.INVALID
            )
        if session.job in self.plan_problems:
            raise self.plan_problems[session.job]
        deadline = time.monotonic() + timeout_s
        while (rc := self.completions.get(session.job, session.rank)) is None:
            if session.job in self.plan_problems:
                raise self.plan_problems[session.job]
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanError(self._waiting_for(session.job), code=ErrorCode.TIMEOUT)
            await self._plan_changed(session.job, left)
        done = await rc.wait(version, max(0.001, deadline - time.monotonic()))
        return msgspec.structs.replace(done, req=req)

    def _notify_engine(self, job: str, rank: int, msg: VersionComplete | VersionFailed) -> None:
        self.local.push(job, "engine", rank, msg)

    def _apply_engine(self, rc: RankCompletion, version: int) -> None:
        """Every write of `version` landed at an engine rank with a delta area: it applies
        the payloads and checks the trailers, then answers with `Applied`."""
        msg = ApplyVersion(
            rank=rc.rank,
            version=version,
            region=rc.expect.delta_region,
            trailers=rc.expect.trailers,
        )
        self.local.push(rc.job, "engine", rc.rank, msg)

    def _verdict(self, rc: RankCompletion, version: int, ok: bool, code: str, message: str) -> None:
        """An engine rank's outcome of `version`, to every node that writes to it."""
        verdict = Verdict(
            node=self.node, slot=rc.expect.slot, rank=rc.rank, ok=ok, code=code, message=message
        )
        for node in rc.expect.sources:
            self.mesh.send_soon(node, VersionVerdict(job=rc.job, version=version, verdict=verdict))

    def applied(self, session: Session, msg: Applied) -> None:
        if session.role != "engine" or msg.rank != session.rank:
            raise WeightwireError(
                f"{session.label} answered for engine rank {msg.rank}", code=ErrorCode.INVALID
            )
        rc = self.completions.get(session.job, session.rank)
        if rc is not None:
            rc.on_applied(msg.version, msg.ok, msg.code, msg.message)

    def on_verdict(self, job: str, version: int, verdict: Verdict) -> None:
        for (j, _), pub in self.publishers.items():
            if j == job:
                pub.on_verdict(version, verdict)

    def session_gone(self, session: Session) -> None:
        if session.role == "trainer":
            pub = self.publishers.pop((session.job, session.rank), None)
            if pub is not None:
                pub.abort(f"trainer rank {session.rank} disconnected mid-version")
                if pub.run is not None and pub.run.tasks:
                    self.detached[(session.job, session.rank)] = pub.run
        if session.role == "engine":
            self.slots.pop((session.job, session.rank), None)
        for region in self.registry.of_session(session.id):
            self.registry.remove(region.local.id)
        if session.sources or session.destinations:
            self.advertise(session.job)
        if session.role != "admin" and not any(
            s.job == session.job and s.role != "admin" for s in self.local.sessions.values()
        ):
            self._forget_job(session.job)

    def _forget_job(self, job: str) -> None:
        """The last rank of `job` here left: its plan and any plan problem go with it (status
        showed them long after). A rank that comes back advertises and gets a plan again."""
        plan = self.plans.pop(job, None)
        problem = self.plan_problems.pop(job, None)
        self.completions.drop_job(job, "every rank of the job here left")
        if plan is not None or problem is not None:
            log.info("job left this node", job=job, plan=plan.plan_hash if plan else None)

    def status(self) -> dict[str, Any]:
        from .status import status

        return status(self)

    async def cluster_status(self, req: int) -> StatusReply:
        from .status import cluster_status

        return StatusReply(req=req, body=await cluster_status(self))
