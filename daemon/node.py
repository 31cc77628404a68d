"""The node daemon: one per host. Composes the local socket, the peer mesh, the
transports, the publishers of its trainer ranks and the completions of its engine
ranks, and (when configured) the coordinator role.
"""

from __future__ import annotations

import asyncio
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
from weightwire.memory.hostmem import sweep_stale
from weightwire.plan.planner import PlanOptions
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import LocalMessage
from weightwire.protocol.peer import (
    Advertise,
    AssignPlan,
    Heartbeat,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    PlanProblem,
    StatusAnswer,
    StatusQuery,
    TransportSignal,
    VersionAbort,
    VersionStart,
    VersionVerdict,
)
from weightwire.protocol.plan import NodePlan
from weightwire.protocol.regions import TransportEndpoints
from weightwire.transport.base import Transport

from .completion import Completions
from .config import DaemonConfig
from .coordinator import Coordinator
from .dataplane import DataPlane
from .joining import JoinWatch
from .local import LocalServer
from .metrics import Prometheus, Recorders
from .names import Refusal
from .notify import Notifier
from .peers import COORDINATOR, PeerMesh
from .plans import PlanKeeping
from .publisher import Publisher
from .ranks import RankService
from .regions import RegionRegistry
from .security import load as load_security
from .security import start_authenticator
from .transports import make_transports
from .versionlog import VersionLog

log = structlog.get_logger("weightwire.daemon")


class Daemon(RankService, PlanKeeping, DataPlane):
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
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            heartbeat_timeout_s=self.cfg.heartbeat_timeout_s,
        )
        self.mesh.names.members = self._bindings
        self.authenticator: Any = None
        self.transports: list[Transport] = make_transports(self.cfg)
        self.registry = RegionRegistry(self.node, self.transports, self.cfg.region_dir)
        self.version_log = VersionLog(self._local_ranks, stale_s=self.cfg.version_timeout_s)
        self.prometheus: Prometheus | None = None
        if self.cfg.metrics_bind:
            self.prometheus = Prometheus(self.node, self._live_peers, self._region_count)
        self.metrics = Recorders(
            self.version_log, *([self.prometheus] if self.prometheus is not None else [])
        )
        self.completions = Completions(
            notify=self._notify_engine,
            apply=self._apply_engine,
            verdict=self._verdict,
            fence=self.fence,
            metrics=self.metrics,
        )
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
        public = self.mesh.security.public_key
        self.join = JoinWatch(
            self.cfg.coordinator or "(this node)",
            self.node,
            public.decode() if public else "(none: insecure)",
            interval_s=10.0,
        )
        self.ready_sent = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        for t in self.transports:
            await t.start(self.completions.on_imm)
            t.set_signal(self._signal_for(t))
            t.set_admission(self.completions.admit)
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
        if self.coordinator is None:
            self.join.attach(self.mesh.socket_to(COORDINATOR))
        self.local.bind(self.ctx)
        self._sweep()
        metrics_at = None
        if self.prometheus is not None:
            host, port = self.prometheus.serve(self.cfg.metrics_bind)
            metrics_at = f"http://{host}:{port}/metrics"
        ready = {
            "node": self.node,
            "peer_endpoint": endpoint,
            "local_socket": self.cfg.local_socket,
            "coordinator": self.cfg.is_coordinator,
            "transports": msgspec.to_builtins(self.endpoints()),
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "metrics": metrics_at,
        }
        log.info("daemon ready", **ready)
        # systemd hears READY once the node has joined (see PeerWelcome); until then, why not
        self.notifier.status(self.join.waiting_for)
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
                if self.coordinator is None:
                    tg.create_task(self.join.watch())
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
        if self.prometheus is not None:
            self.prometheus.close()
        self.ctx.term()
        log.info("daemon stopped")

    def reload_keys(self) -> None:
        """SIGHUP: the trusted keys read again (rekey.py)."""
        from .rekey import reload_keys

        reload_keys(self)

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
                if self.coordinator_name is not None:
                    self.join.on_left()
                self.coordinator_name = None
                self.join.check(now)
                if self.join.refused_key:  # a fresh socket, so a fresh handshake (after SIGHUP)
                    self.mesh.reconnect(COORDINATOR)
                    self.join.attach(self.mesh.socket_to(COORDINATOR))
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
            self.version_log.flush()
            self.notifier.watchdog()
            if now - last_sweep >= 60.0:
                last_sweep = now
                self._sweep()
            if now - last_status >= 5.0:
                last_status = now
                joined = self.coordinator_name is not None
                self.notifier.status(self._one_line_status() if joined else self.join.waiting_for)
            await asyncio.sleep(interval)

    def _sweep(self) -> None:
        try:
            removed = sweep_stale(self.cfg.region_dir)
        except OSError as exc:
            log.warning("could not sweep region files", dir=self.cfg.region_dir, error=str(exc))
            return
        if removed:
            log.info("removed region files of exited ranks", files=len(removed))

    def _local_ranks(self, job: str) -> set[tuple[str, int]]:
        trainers = {("trainer", r) for j, r in self.publishers if j == job}
        return trainers | {("engine", r) for j, r in self.completions.ranks if j == job}

    def _live_peers(self) -> int:
        timeout = self.cfg.heartbeat_timeout_s
        return sum(1 for m in list(self.members) if m != self.node and self.mesh.alive(m, timeout))

    def _region_count(self) -> int:
        return len(self.registry.regions)

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
        self._spawn(self.fence((node,), reason))  # nothing of its lands here from now on
        for rc in self.completions.ranks.values():
            rc.fail_in_progress(ErrorCode.PEER_LOST, reason, source=node)
        for job, plan in list(self.plans.items()):
            if node not in self._nodes_of(plan):
                continue
            if self._elastic_engine_node(plan, node):
                # an engine replica's node: only that replica is dropped from the version
                # in flight; the coordinator sends the plan without it
                for (j, _), pub in self.publishers.items():
                    if j == job:
                        pub.drop_nodes({node}, reason)
                continue
            self._withdraw(job, f"plan withdrawn: {reason}")

    async def fence(self, nodes: tuple[str, ...], reason: str) -> None:
        """Stop every write of `nodes` landing here, on every transport, before a failure
        is reported (bounded: each transport's fence is)."""
        jobs = [t.fence(n, reason) for t in self.transports for n in nodes]
        try:
            async with asyncio.timeout(self.cfg.stall_timeout_s):
                outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        except TimeoutError:
            log.error("fence timed out", peers=list(nodes), reason=reason)
            return
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.error("fence failed", peers=list(nodes), error=repr(outcome))

    def node_back(self, node: str) -> None:
        if node in self.lost:
            self.lost.discard(node)
            log.info("peer back", peer=node)
            for job in {s.job for s in self.local.sessions.values()}:
                self.advertise(job)

    # --- peer messages -------------------------------------------------------

    def _bindings(self) -> dict[str, Member]:
        """Node name -> member (and so its key): the coordinator's own table where this node
        coordinates, else the membership the coordinator last sent."""
        return self.coordinator.members if self.coordinator is not None else self.members

    async def on_peer(self, sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        """A message the mesh admitted: `sender` is bound to `key` (see names.py)."""
        if self.coordinator is not None:
            self.coordinator.seen(sender)
        match msg:
            case PeerHello():
                if self.coordinator is None:
                    self.mesh.send_soon(
                        sender, PeerError(code="not_coordinator", message=f"{self.node} is not")
                    )
                elif refusal := self.coordinator.binding_refusal(msg.member, key):
                    self.mesh.refusals.refused(sender, key, "PeerHello", Refusal(refusal))
                else:
                    self.mesh.know(sender, msg.member.endpoint, _key(msg.member.public_key))
                    self.coordinator.on_hello(sender, msg)
            case PeerWelcome(coordinator=name):
                if self.coordinator_name != name:
                    log.info("joined", coordinator=name)
                self.coordinator_name = name
                self.join.on_joined()
                if not self.ready_sent:
                    self.ready_sent = True
                    self.notifier.ready(
                        f"joined {name}; serving {self.cfg.local_socket}; "
                        f"peers at {self.mesh.endpoint}"
                    )
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
            case VersionVerdict(job=job, version=version, verdict=verdict):
                self.on_verdict(job, version, verdict)
            case TransportSignal(reply=True):
                self.mesh.resolve(sender, msg.req, msg)
            case TransportSignal(transport=name, payload=payload):
                self._spawn(self._answer_signal(sender, msg.req, name, payload))
            case StatusQuery():
                self.mesh.send_soon(sender, StatusAnswer(req=msg.req, body=self.status()))
            case StatusAnswer():
                self.mesh.resolve(sender, msg.req, msg)
            case PeerError(code=code, message=message) if self.coordinator_name is None:
                self.join.refused(code, message)  # said by JoinWatch, once per interval
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


def _key(text: str) -> bytes | None:
    return text.encode() if text else None


class _Stop(Exception):
    pass


__all__ = ["Daemon"]
