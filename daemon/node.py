"""The node daemon: one per host. Composes the local socket, the peer mesh, the
transports, the publishers of its trainer ranks and the completions of its engine
ranks, and (when configured) the coordinator role.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

import weightwire
from weightwire.plan.planner import PlanOptions
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PeerLostError, PlanError, WeightwireError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import (
    LocalMessage,
    PlanReply,
    PublishResult,
    VersionComplete,
    VersionFailed,
)
from weightwire.protocol.peer import (
    Advertise,
    AssignPlan,
    Heartbeat,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerMsg,
    PeerWelcome,
    PlanProblem,
    RankAdvert,
    TransportSignal,
    VersionAbort,
    VersionStart,
)
from weightwire.protocol.plan import MAX_SLOTS, NodePlan
from weightwire.protocol.regions import RegionDescriptor, TransportEndpoints
from weightwire.transport.base import LocalRegion, Transport
from weightwire.transport.hostmem import sweep_stale

from .completion import Completions
from .config import DaemonConfig
from .coordinator import Coordinator
from .local import LocalServer
from .notify import Notifier
from .peers import PeerMesh
from .publisher import Publisher
from .regions import Region, RegionRegistry
from .security import load as load_security
from .security import start_authenticator
from .sessions import Session
from .transports import make_transports

log = structlog.get_logger("weightwire.daemon")

COORDINATOR = "@coordinator"  # the mesh's name for the coordinator until it says its own


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.cfg = config.resolved()
        security = load_security(self.cfg)
        self.node = self.cfg.node
        self.version = weightwire.__version__
        self.incarnation = secrets.token_hex(8)
        self.started = time.time()
        self.ctx = zmq.asyncio.Context()
        self.mesh = PeerMesh(
            self.node,
            self.ctx,
            Codec(PeerMessage, max_bytes=self.cfg.max_message_bytes),
            security,
        )
        self.authenticator: Any = None
        self.transports: list[Transport] = make_transports(self.cfg)
        self.registry = RegionRegistry(self.node, self.transports)
        self.completions = Completions(notify=self._notify_engine)
        self.local = LocalServer(
            self,
            self.cfg.local_socket,
            self.cfg.socket_mode,
            Codec(LocalMessage, max_bytes=self.cfg.max_message_bytes),
        )
        self.options = PlanOptions(
            bucket_bytes=self.cfg.bucket_bytes, max_write_bytes=self.cfg.max_write_bytes
        )
        self.coordinator: Coordinator | None = None
        self.coordinator_name: str | None = None
        self.coordinator_incarnation: str | None = None
        self.members: dict[str, Member] = {}
        self.plans: dict[str, NodePlan] = {}
        self.plan_problems: dict[str, PlanError] = {}
        self.plan_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self.publishers: dict[tuple[str, int], Publisher] = {}
        self.detached: dict[tuple[str, int], Any] = {}
        self.slots: dict[tuple[str, int], int] = {}  # runs of gone sessions still writing
        self.related_since: dict[str, float] = {}
        self.lost: set[str] = set()
        self.advert_seq = 0
        self.stop = asyncio.Event()
        self.notifier = Notifier()
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        for t in self.transports:
            await t.start(self.completions.on_imm)
            t.set_signal(self._signal_for(t))
        self.authenticator = start_authenticator(self.ctx, self.mesh.security)
        endpoint = self.mesh.bind(self.cfg.peer_bind, self.cfg.advertise_host)
        if self.cfg.is_coordinator:
            self.coordinator = Coordinator(
                node=self.node,
                send=self.mesh.send_soon,
                options=self.options,
                heartbeat_timeout_s=self.cfg.heartbeat_timeout_s,
            )
        self.mesh.know(
            COORDINATOR, self.cfg.coordinator or endpoint, self.mesh.security.coordinator_key
        )
        self.local.bind(self.ctx)
        self._sweep()
        ready = {
            "node": self.node,
            "peer_endpoint": endpoint,
            "local_socket": self.cfg.local_socket,
            "coordinator": self.cfg.is_coordinator,
            "transports": msgspec.to_builtins(self.endpoints()),
            "pid": os.getpid(),
            "incarnation": self.incarnation,
        }
        log.info("daemon ready", **ready)
        self.notifier.ready(f"serving {self.cfg.local_socket}; peers at {endpoint}")
        if self.cfg.ready_file:
            tmp = self.cfg.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(ready, f)
            os.replace(tmp, self.cfg.ready_file)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.mesh.serve(self.on_peer))
                tg.create_task(self.local.serve())
                tg.create_task(self._tick())
                await self.stop.wait()
                raise _Stop
        except* _Stop:
            pass
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        log.info("daemon stopping")
        self.notifier.stopping()
        for pub in self.publishers.values():
            pub.abort("the daemon is shutting down", ErrorCode.PEER_LOST)
        try:
            async with asyncio.timeout(self.cfg.shutdown_timeout_s):
                for t in self.transports:
                    await t.close()
        except TimeoutError:
            log.warning("transports did not close in time")
        for task in self._tasks:
            task.cancel()
        self.local.close()
        self.mesh.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.registry.close()
        self.ctx.term()
        log.info("daemon stopped")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def endpoints(self) -> TransportEndpoints:
        merged: dict[str, Any] = {}
        for t in self.transports:
            for k, v in msgspec.structs.asdict(t.endpoints()).items():
                if v is not None:
                    merged[k] = v
        return TransportEndpoints(**merged)

    def member(self) -> Member:
        public = self.mesh.security.public_key
        return Member(
            node=self.node,
            endpoint=self.mesh.endpoint,
            incarnation=self.incarnation,
            transports=self.endpoints(),
            public_key=public.decode() if public else "",
        )

    # --- periodic work: joining, heartbeats, liveness ------------------------

    async def _tick(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        last_hello = 0.0
        last_status = 0.0
        last_sweep = time.monotonic()
        while True:
            now = time.monotonic()
            if self.coordinator is not None:
                self.mesh.last_seen[self.node] = now  # the coordinator is never lost to itself
            if (
                self.coordinator_name is None
                or not self.mesh.alive(self.coordinator_name, self.cfg.heartbeat_timeout_s)
            ) and now - last_hello >= 1.0:
                self.coordinator_name = None
                self.mesh.send_soon(
                    COORDINATOR, PeerHello(protocol=PROTOCOL_VERSION, member=self.member())
                )
                last_hello = now
            beat = Heartbeat(node=self.node, incarnation=self.incarnation)
            targets = set(self.related_since)
            if self.coordinator is not None:
                targets |= set(self.coordinator.members)
            elif self.coordinator_name is not None:
                targets.add(self.coordinator_name)
            for node in targets - {self.node}:
                self.mesh.send_soon(node, beat)
            if self.coordinator is not None:
                self.coordinator.check_liveness()
            self._check_related(now)
            for rc in self.completions.ranks.values():
                rc.expire(self.cfg.version_timeout_s)
            self.local.expire(self.cfg.session_timeout_s)
            self.registry.reap()
            self.notifier.watchdog()
            if now - last_sweep >= 60.0:
                last_sweep = now
                self._sweep()
            if now - last_status >= 5.0:
                last_status = now
                self.notifier.status(self._one_line_status())
            await asyncio.sleep(interval)

    def _sweep(self) -> None:
        removed = sweep_stale()
        if removed:
            log.info("removed region files of exited ranks", files=len(removed))

    def _one_line_status(self) -> str:
        timeout = self.cfg.heartbeat_timeout_s
        live = sum(1 for m in self.members if m == self.node or self.mesh.alive(m, timeout))
        busy = sum(1 for p in self.publishers.values() if p.run and not p.run.finished)
        return (
            f"{len(self.local.sessions)} ranks, {len(self.registry.regions)} regions, "
            f"{live} peers, {busy} publishing, coordinator {self.coordinator_name or '-'}"
        )

    def _check_related(self, now: float) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        for node, since in self.related_since.items():
            if node == self.node or node in self.lost:
                continue
            if now - since > timeout and not self.mesh.alive(node, timeout):
                self.node_lost(node, f"no heartbeat from {node} for {timeout:.1f} s")

    def node_lost(self, node: str, reason: str) -> None:
        if node in self.lost:
            return
        self.lost.add(node)
        log.warning("peer lost", peer=node, reason=reason)
        for t in self.transports:
            self._spawn(t.disconnect(node, reason))
        for rc in self.completions.ranks.values():
            rc.fail_in_progress(ErrorCode.PEER_LOST, reason, source=node)
        for job, plan in list(self.plans.items()):
            if node in self._nodes_of(plan):
                self._withdraw(job, f"plan withdrawn: {reason}")

    def node_back(self, node: str) -> None:
        if node in self.lost:
            self.lost.discard(node)
            log.info("peer back", peer=node)
            for job in {s.job for s in self.local.sessions.values()}:
                self.advertise(job)

    @staticmethod
    def _nodes_of(plan: NodePlan) -> set[str]:
        nodes = {r.node for s in plan.sends for r in s.regions}
        return nodes | {n for e in plan.expects for n in e.sources}

    def _withdraw(self, job: str, reason: str) -> None:
        """Stop using a job's plan (it involves a lost node) until the coordinator sends one."""
        plan = self.plans.pop(job, None)
        if plan is None:
            return
        log.warning("plan withdrawn", job=job, plan=plan.plan_hash, reason=reason)
        for (j, _), pub in self.publishers.items():
            if j == job:
                pub.set_plan(None, reason)
        self.advertise(job)

    # --- peer messages -------------------------------------------------------

    async def on_peer(self, sender: str, msg: PeerMessage) -> None:
        if self.coordinator is not None:
            self.coordinator.seen(sender)
        match msg:
            case PeerHello():
                if self.coordinator is None:
                    self.mesh.send_soon(
                        sender, PeerError(code="not_coordinator", message=f"{self.node} is not")
                    )
                else:
                    self.mesh.know(sender, msg.member.endpoint, _key(msg.member.public_key))
                    self.coordinator.on_hello(sender, msg)
            case PeerWelcome(coordinator=name):
                if self.coordinator_name != name:
                    log.info("joined", coordinator=name)
                self.coordinator_name = name
                self.mesh.know(
                    name, self._coordinator_endpoint(), self.mesh.security.coordinator_key
                )
                for job in {s.job for s in self.local.sessions.values()} | set(self.plans):
                    self.advertise(job)
            case Membership(members=members, lost=lost):
                self._membership(members, lost)
            case Advertise():
                if self.coordinator is not None:
                    self.coordinator.on_advertise(sender, msg)
            case AssignPlan(plan=plan):
                self.install_plan(plan)
            case PlanProblem(job=job, code=code, message=message):
                self._plan_problem(job, PlanError(message, code=ErrorCode(code)))
            case Heartbeat(node=node, incarnation=inc):
                self._heartbeat(node, inc)
            case VersionStart(job=job, version=version, source_node=src):
                for rc in self.completions.of_job(job):
                    if src in rc.expect.sources:
                        rc.on_start(version, src)
            case VersionAbort(job=job, version=version, source_node=src, message=message):
                for rc in self.completions.of_job(job):
                    if src in rc.expect.sources:
                        rc.fail(version, ErrorCode.ABORTED, f"{src}: {message}")
            case TransportSignal(reply=True):
                self.mesh.resolve(msg.req, msg)
            case TransportSignal(transport=name, payload=payload):
                self._spawn(self._answer_signal(sender, msg.req, name, payload))
            case PeerError(code=code, message=message):
                log.warning("peer reported an error", peer=sender, code=code, error=message)

    def _coordinator_endpoint(self) -> str:
        return self.cfg.coordinator or self.mesh.endpoint

    def _membership(self, members: tuple[Member, ...], lost: tuple[str, ...]) -> None:
        for m in members:
            old = self.members.get(m.node)
            self.members[m.node] = m
            if m.node != self.node:
                self.mesh.know(m.node, m.endpoint, _key(m.public_key))
            if old is not None and old.incarnation != m.incarnation:
                self.node_lost(m.node, f"{m.node} restarted")
                self.node_back(m.node)
        for node in lost:
            self.members.pop(node, None)
            self.node_lost(node, f"the coordinator lost {node}")

    def _heartbeat(self, node: str, incarnation: str) -> None:
        if node == self.coordinator_name and incarnation != self.coordinator_incarnation:
            if self.coordinator_incarnation is not None:
                log.info("coordinator restarted; joining again", peer=node)
                self.coordinator_name = None  # the next tick says hello again
            self.coordinator_incarnation = incarnation
        member = self.members.get(node)
        if member is not None and member.incarnation != incarnation:
            self.node_lost(node, f"{node} restarted")
        if member is None or member.incarnation == incarnation:
            self.node_back(node)

    # --- advertising and plans -----------------------------------------------

    def advertise(self, job: str) -> None:
        ranks: list[RankAdvert] = []
        for s in sorted(self.local.sessions.values(), key=lambda s: (s.role, s.rank)):
            if s.job != job:
                continue
            if s.role == "trainer" and s.sources:
                ranks.append(
                    RankAdvert(
                        role="trainer",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        sources=tuple(s.sources.values()),
                        lanes=self._lanes(s),
                    )
                )
            elif s.role == "engine" and s.destinations:
                ranks.append(
                    RankAdvert(
                        role="engine",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        destinations=tuple(s.destinations.values()),
                        layout=s.layout,
                        regions=tuple(r.descriptor for r in self.registry.of_session(s.id)),
                        slot=self._slot(s.job, s.rank),
                        lanes=self._lanes(s),
                    )
                )
        self.advert_seq += 1
        self.mesh.send_soon(
            self.coordinator_name or COORDINATOR,
            Advertise(
                node=self.node,
                incarnation=self.incarnation,
                job=job,
                ranks=tuple(ranks),
                seq=self.advert_seq,
                plan_hash=self.plans[job].plan_hash if job in self.plans else "",
            ),
        )

    def _lanes(self, session: Session) -> int:
        """How many paths (NICs) this node's data planes have for the rank's memory."""
        return max(t.lanes(session.hello.device_uuid) for t in self.transports)

    def _slot(self, job: str, rank: int) -> int:
        """The immediate counter of an engine rank here: stable while its session lives."""
        key = (job, rank)
        if key not in self.slots:
            used = set(self.slots.values())
            self.slots[key] = next(i for i in range(MAX_SLOTS) if i not in used)
        return self.slots[key]

    def install_plan(self, plan: NodePlan) -> None:
        old = self.plans.get(plan.job)
        self.plans[plan.job] = plan
        self.plan_problems.pop(plan.job, None)
        if old is None or old.plan_hash != plan.plan_hash:
            log.info(
                "plan installed",
                job=plan.job,
                plan=plan.plan_hash,
                trainer_ranks=[s.rank for s in plan.sends],
                engine_ranks=[e.rank for e in plan.expects],
            )
        for rp in plan.sends:
            pub = self.publishers.get((plan.job, rp.rank))
            if pub is not None:
                pub.set_plan(rp)
        self.completions.install(plan.job, plan.plan_hash, plan.expects)
        related = self._nodes_of(plan)
        now = time.monotonic()
        self.related_since = {
            n: self.related_since.get(n, now) for n in related | set(self._other_related(plan.job))
        }
        for node in related - {self.node}:
            self._spawn(self._connect_quietly(node))
        for fut in self.plan_waiters.pop(plan.job, []):
            if not fut.done():
                fut.set_result(None)

    def _other_related(self, job: str) -> set[str]:
        nodes: set[str] = set()
        for name, p in self.plans.items():
            if name == job:
                continue
            nodes |= {r.node for s in p.sends for r in s.regions}
            nodes |= {n for e in p.expects for n in e.sources}
        return nodes

    async def _connect_quietly(self, node: str) -> None:
        with contextlib.suppress(WeightwireError):
            await self.transport_to(node)

    def _plan_problem(self, job: str, err: PlanError) -> None:
        self.plans.pop(job, None)
        self.plan_problems[job] = err
        self.completions.drop_job(job, err.message)
        for fut in self.plan_waiters.pop(job, []):
            if not fut.done():
                fut.set_exception(err)

    async def transport_to(
        self, node: str, src: LocalRegion | None = None, dst: RegionDescriptor | None = None
    ) -> Transport:
        """The preferred transport that reaches `node` and carries src -> dst, connected."""
        member = self.members.get(node)
        if member is None:
            raise PeerLostError(f"node {node} is not a member of the cluster")
        for t in self.transports:
            if not t.can_reach(member.transports):
                continue
            if src is not None and dst is not None and not t.accepts(src, dst):
                continue
            await t.connect(node, member.transports)
            return t
        raise PeerLostError(f"no transport of {self.node} reaches {node} for this write")

    # --- signals between transport instances ---------------------------------

    def _signal_for(self, transport: Transport) -> Any:
        async def signal(node: str, payload: bytes) -> bytes:
            msg = TransportSignal(transport=transport.name, node=self.node, payload=payload)
            reply = await self.mesh.request(node, msg, self.cfg.stall_timeout_s)
            if not isinstance(reply, TransportSignal):
                raise PeerLostError(f"{node} answered a {transport.name} signal with {reply}")
            return reply.payload

        return signal

    async def _answer_signal(self, sender: str, req: int, name: str, payload: bytes) -> None:
        transport = next((t for t in self.transports if t.name == name), None)
        if transport is None:
            self.mesh.send_soon(sender, PeerError(code="invalid", message=f"no transport {name}"))
            return
        answer = await transport.on_signal(sender, payload)
        self.mesh.send_soon(
            sender,
            TransportSignal(req=req, transport=name, node=self.node, payload=answer, reply=True),
        )

    # --- what the local server asks of the daemon ----------------------------

    def publisher(self, session: Session) -> Publisher:
        if session.role != "trainer":
            raise WeightwireError(f"a {session.role} session cannot publish")
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
            )
            pub.previous = self.detached.pop(key, None)
            self.publishers[key] = pub
            plan = self.plans.get(session.job)
            for rp in plan.sends if plan else ():
                if rp.rank == session.rank:
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
        elif session.role == "engine" and session.destinations:
            self.advertise(session.job)

    async def plan_for(self, session: Session, req: int, timeout_s: float) -> PlanReply:
        if session.role != "trainer":
            raise WeightwireError(f"a {session.role} session has no send plan")
        if not session.sources:
            raise PlanError("declare this rank's tensors before asking for its plan")
        deadline = time.monotonic() + timeout_s
        while True:
            if session.job in self.plan_problems:
                raise self.plan_problems[session.job]
            plan = self.plans.get(session.job)
            rp = next((s for s in plan.sends if s.rank == session.rank), None) if plan else None
            if rp is not None:
                self.publisher(session)
                return PlanReply(req=req, plan=rp)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanError(self._waiting_for(session.job), code=ErrorCode.NOT_READY)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.plan_waiters.setdefault(session.job, []).append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, left)

    def _waiting_for(self, job: str) -> str:
        if self.coordinator_name is None:
            return f"no plan for job {job!r}: not joined to the coordinator yet"
        if self.coordinator is not None:
            missing = self.coordinator.status()["jobs"]
            info = missing.get(job, {}) if isinstance(missing, dict) else {}
            return f"no plan for job {job!r} yet; waiting for {info.get('missing')}"
        return f"no plan for job {job!r} yet: the coordinator is waiting for more ranks"

    async def begin_version(self, session: Session, req: int, version: int, plan_hash: str) -> Any:
        from weightwire.protocol.local import Ok

        pub = self.publisher(session)
        await pub.drain(self.cfg.stall_timeout_s)
        pub.begin(version, plan_hash)
        return Ok(req=req, detail=f"version {version}")

    async def wait_version(
        self, session: Session, req: int, version: int, timeout_s: float
    ) -> VersionComplete:
        if session.role != "engine":
            raise WeightwireError(f"a {session.role} session does not receive versions")
        if session.job in self.plan_problems:
            raise self.plan_problems[session.job]
        deadline = time.monotonic() + timeout_s
        while (rc := self.completions.get(session.job, session.rank)) is None:
            if session.job in self.plan_problems:
                raise self.plan_problems[session.job]
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanError(self._waiting_for(session.job), code=ErrorCode.TIMEOUT)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.plan_waiters.setdefault(session.job, []).append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, left)
        done = await rc.wait(version, max(0.001, deadline - time.monotonic()))
        return msgspec.structs.replace(done, req=req)

    def _notify_engine(self, job: str, rank: int, msg: VersionComplete | VersionFailed) -> None:
        self.local.push(job, "engine", rank, msg)

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

    def status(self) -> dict[str, Any]:
        from .status import status

        return status(self)


def _key(text: str) -> bytes | None:
    return text.encode() if text else None


class _Stop(Exception):
    pass


__all__ = ["Daemon", "PublishResult"]
