"""What the ranks of this host ask of the daemon (the local socket's `Requests`):
declaring tensors and regions, plans, publishing, waiting for versions, and what a rank
leaves behind when it goes."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from weightwire.protocol.errors import ErrorCode, PlanError, ProtocolError, WeightwireError
from weightwire.protocol.local import (
    AbortVersion,
    Applied,
    BucketReady,
    DeclareDestinations,
    DeclareSources,
    Ok,
    PlanReply,
    RegionRegistered,
    RegisterRegion,
    RemapRegion,
    TrailersReady,
    VersionComplete,
)

from .completions import Completions
from .plans import PlanBook
from .publishing import Publishing
from .regions import Region, RegionRegistry
from .seams import Joining
from .sessions import Session


class Ranks:
    def __init__(
        self,
        registry: RegionRegistry,
        plans: PlanBook,
        publishing: Publishing,
        completions: Completions,
        joining: Joining,
        sessions: Mapping[bytes, Session],
        stall_timeout_s: float,
    ) -> None:
        self._registry = registry
        self._plans = plans
        self._publishing = publishing
        self._completions = completions
        self._joining = joining
        self._sessions = sessions
        self._stall_timeout_s = stall_timeout_s
        self._unmapping: set[asyncio.Task[None]] = set()  # gone ranks' regions, later

    # --- declarations --------------------------------------------------------

    def declare_sources(self, session: Session, msg: DeclareSources) -> None:
        session.declare_sources(msg.tensors)
        self._plans.advertise(session.job)

    def declare_destinations(self, session: Session, msg: DeclareDestinations) -> None:
        session.declare_destinations(msg.tensors, msg.layout, self._registry.regions)
        self._plans.advertise(session.job)

    async def register(
        self, session: Session, msg: RegisterRegion, alive: Callable[[], bool]
    ) -> RegionRegistered:
        """Registering pins memory (RDMA: seconds for a large region): off the loop.
        `alive()` says whether the session is still here once it is done."""
        reg = self._registry
        add = (
            functools.partial(reg.add_cuda, msg.cuda)
            if msg.cuda is not None
            else functools.partial(reg.add_shared, msg.path)
        )
        region = await asyncio.to_thread(add, msg.length, msg.purpose, session.id, session.label)
        if not alive():  # it left meanwhile
            reg.remove(region.local.id)
            raise ProtocolError("the session ended during registration", code=ErrorCode.NO_SESSION)
        self._region_added(session, region)
        return RegionRegistered(req=msg.req, region=region.local.id)

    async def remap(self, session: Session, msg: RemapRegion) -> Ok:
        """The rank's GPU memory behind a region was released or replaced (SGLang's
        memory saver): writes into it stop now, on the loop; the old mapping is dropped
        and the new one made off it; peers learn the region's new keys."""
        region = self._registry.detach(msg.region, session.id)
        keyed = region.descriptor.keys.cuda is not None
        await asyncio.to_thread(self._registry.remap_cuda, region, msg.cuda)
        if msg.cuda is None:
            if keyed and session.role == "engine" and session.destinations:
                # advertised without its CUDA key now (`remap_cuda`): planned again, and a
                # daemon of this host that opened the memory by the key lets it go
                self._plans.advertise(session.job)
            return Ok(req=msg.req, detail=f"region {msg.region} released")
        self._region_added(session, region)
        return Ok(req=msg.req, detail=f"region {msg.region} remapped")

    def _region_added(self, session: Session, region: Region) -> None:
        if session.role == "trainer" and region.purpose == "staging":
            self._publishing.publisher(session).staging = region.local
        elif session.role == "trainer" and region.purpose == "delta":
            self._publishing.publisher(session).delta_out = region.local
        elif session.role == "engine" and session.destinations:
            self._plans.advertise(session.job)
        self._plans.grant_writers()

    # --- trainer ranks -------------------------------------------------------

    async def plan_for(
        self, session: Session, req: int, timeout_s: float, after_plan: str = ""
    ) -> PlanReply:
        """The rank's plan once there is one (other than `after_plan`, which predates
        tensors the rank declared since: a version on it would leave them out)."""
        if session.role != "trainer":
            raise WeightwireError(
                f"a {session.role} session has no send plan", code=ErrorCode.INVALID
            )
        if not session.sources:
            raise PlanError("declare this rank's tensors before asking for its plan")
        deadline = time.monotonic() + timeout_s
        while True:
            self._plans.check(session.job)
            rp = self._plans.rank_plan(session.job, session.rank)
            if rp is not None and not (after_plan and rp.plan_hash == after_plan):
                self._publishing.publisher(session).served = rp.regions
                return PlanReply(req=req, plan=rp)
            left = deadline - time.monotonic()
            if left <= 0:
                if rp is not None:  # only the plan it declared tensors after
                    why = (
                        f"no plan of job {session.job!r} knows the tensors this rank declared "
                        f"after plan {after_plan} within {timeout_s:g} s (has every rank "
                        "that shares them declared its side?)"
                    )
                else:
                    waiting = self._joining.waiting_for(session.job)
                    why = self._plans.waiting(session.job, timeout_s, waiting)
                raise PlanError(why, code=ErrorCode.NOT_READY)
            await self._plans.changed(session.job, left)

    async def begin_version(
        self,
        session: Session,
        req: int,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence: tuple[int, int, int] = (-1, 0, -1),
    ) -> Ok:
        pub = self._publishing.publisher(session)
        await pub.drain(self._stall_timeout_s)
        pub.begin(version, plan_hash, staging_buckets, slot_events, *fence)
        return Ok(req=req, detail=f"version {version}")

    def begin_version_now(
        self,
        session: Session,
        req: int,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence: tuple[int, int, int] = (-1, 0, -1),
        *,
        answer: Callable[[Ok], None],
    ) -> bool:
        """`begin_version` answered on the spot, without a task, when no write of an earlier
        version is in flight (the usual case): the rank is answered (`answer`) before the
        version is announced to its destinations, so their sends are not on the rank's round
        trip (engines count immediates before a source's announce arrives: safe). False: it
        must wait for those writes first (nothing done)."""
        pub = self._publishing.publisher(session)
        if not pub.settled():
            return False
        pub.begin(version, plan_hash, staging_buckets, slot_events, *fence, announce=False)
        answer(Ok(req=req, detail=f"version {version}"))
        pub.started()
        return True

    def bucket_ready(self, session: Session, msg: BucketReady) -> bool:
        pub = self._publishing.publisher(session)
        return pub.bucket_ready(msg.version, (msg.bucket, *msg.more), msg.delta, msg.in_place)

    def trailers_ready(self, session: Session, msg: TrailersReady) -> None:
        self._publishing.publisher(session).trailers_ready(msg.version, msg.lengths)

    def abort_version(self, session: Session, msg: AbortVersion) -> None:
        self._publishing.publisher(session).abort(
            f"version {msg.version} aborted by the rank: {msg.reason}"
        )

    # --- engine ranks --------------------------------------------------------

    async def wait_version(
        self, session: Session, req: int, version: int, timeout_s: float
    ) -> VersionComplete:
        if session.role != "engine":
            raise WeightwireError(
                f"a {session.role} session does not receive versions", code=ErrorCode.INVALID
            )
        self._plans.check(session.job, session.rank)
        deadline = time.monotonic() + timeout_s
        while (rc := self._completions.get(session.job, session.rank)) is None:
            self._plans.check(session.job, session.rank)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanError(self._joining.waiting_for(session.job), code=ErrorCode.TIMEOUT)
            await self._plans.changed(session.job, left)
        done = await rc.wait(version, max(0.001, deadline - time.monotonic()))
        return msgspec.structs.replace(done, req=req)

    def applied(self, session: Session, msg: Applied) -> None:
        if session.role != "engine" or msg.rank != session.rank:
            raise WeightwireError(
                f"{session.label} answered for engine rank {msg.rank}", code=ErrorCode.INVALID
            )
        rc = self._completions.get(session.job, session.rank)
        if rc is not None:
            rc.on_applied(msg.version, msg.ok, msg.code, msg.message)

    # --- leaving -------------------------------------------------------------

    async def _unmap_after(self, reading: Awaitable[None], regions: list[int]) -> None:
        try:
            await reading
        finally:
            for region_id in regions:
                self._registry.remove(region_id)

    def session_gone(self, session: Session) -> None:
        reading: Awaitable[None] | None = None
        if session.role == "trainer":
            reading = self._publishing.session_gone(session)
        if session.role == "engine":
            self._plans.release_slot(session.job, session.rank)
        gone = [region.local.id for region in self._registry.of_session(session.id)]
        if reading is not None:  # the GPU may still read or write its staging: unmap after
            task = asyncio.get_running_loop().create_task(self._unmap_after(reading, gone))
            self._unmapping.add(task)
            task.add_done_callback(self._unmapping.discard)
        else:
            for region_id in gone:
                self._registry.remove(region_id)
        if session.sources or session.destinations:
            self._plans.advertise(session.job)
        if session.role != "admin" and not any(
            s.job == session.job and s.role != "admin" for s in self._sessions.values()
        ):
            self._plans.forget(session.job)
