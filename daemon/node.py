"""The node daemon: one per host. The composition root: builds the services (the local
socket, the peer mesh and cluster, the data plane, the plans, the publishers of its trainer
ranks and the completions of its engine ranks, and the coordinator role when configured),
wires each to the narrow seams it needs, and runs them in one TaskGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
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
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import LocalMessage
from weightwire.protocol.peer import Member, PeerMessage
from weightwire.protocol.plan import NodePlan

from .cluster import Cluster
from .completions import Completions
from .config import DaemonConfig
from .coordinator import Coordinator
from .dataplane import DataPlane
from .engines import EngineOutbox
from .joining import JoinWatch
from .local import LocalServer
from .membership import Membership
from .metrics import Prometheus, Recorders
from .notify import Notifier
from .peers import COORDINATOR, PeerMesh
from .plans import PlanBook
from .publishing import Publishing
from .rankrequests import Identity
from .ranks import Ranks
from .regions import RegionRegistry
from .rekey import reload_keys
from .security import load as load_security
from .security import start_authenticator
from .sessions import Session
from .status import StatusReport
from .tasks import Tasks
from .transports import make_transports
from .versionlog import VersionLog

log = structlog.get_logger("weightwire.daemon")


def write_ready_file(path: str, ready: dict[str, object]) -> None:
    """`ready` as JSON at `path`, whole or not at all (a temporary file renamed); a
    WeightwireError naming the path when it cannot be written (a full disk: `no_space`)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(ready, f)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        code = ErrorCode.NO_SPACE if full else ErrorCode.INVALID
        raise WeightwireError(
            f"cannot write ready_file {path}: {exc.strerror or exc}", code=code
        ) from None


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        cfg = self.cfg = config.resolved()
        security = load_security(cfg)
        node = self.node = cfg.node
        incarnation = self.incarnation = secrets.token_hex(8)
        self.stop = asyncio.Event()
        self.notifier = Notifier()
        self.tasks = Tasks()
        self.ctx = zmq.asyncio.Context()
        self.authenticator: Any = None
        self.mesh = PeerMesh(
            node,
            self.ctx,
            Codec(PeerMessage, max_bytes=cfg.max_message_bytes),
            security,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        )
        options = PlanOptions(
            bucket_bytes=cfg.bucket_bytes,
            tail_bytes=cfg.bucket_tail_bytes,
            max_write_bytes=cfg.max_write_bytes,
        )
        coordinator = (
            Coordinator(
                node=node,
                send=self.mesh.send_soon,
                options=options,
                heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                max_bytes=cfg.max_message_bytes,
            )
            if cfg.is_coordinator
            else None
        )
        self.view = Membership(node, incarnation, coordinator=coordinator)
        self.mesh.names.members = self.view.bindings
        sessions: dict[bytes, Session] = {}
        installed: dict[str, NodePlan] = {}
        transports = make_transports(cfg)
        self.registry = RegionRegistry(node, transports, cfg.region_dir)
        self.version_log = VersionLog(self._local_ranks, stale_s=cfg.version_timeout_s)
        self.prometheus: Prometheus | None = None
        if cfg.metrics_bind:
            self.prometheus = Prometheus(node, self._live_peers, self._region_count)
        self.metrics = Recorders(
            self.version_log, *([self.prometheus] if self.prometheus is not None else [])
        )
        public = self.mesh.security.public_key
        self.join = JoinWatch(
            cfg.coordinator or "(this node)",
            node,
            public.decode() if public else "(none: insecure)",
            interval_s=10.0,
        )
        self.dataplane = DataPlane(
            node,
            transports,
            self.view.members,
            self.mesh,
            self.tasks,
            cfg.stall_timeout_s,
        )
        self.local = LocalServer(
            cfg.local_socket,
            cfg.socket_mode,
            Codec(LocalMessage, max_bytes=cfg.max_message_bytes),
            Identity(node, incarnation, weightwire.__version__, cfg.region_dir),
            sessions,
            lambda: self.status(),  # built last, from every part
            lambda: self.status.whole_cluster(),
        )
        self.registry.claim_fds = self.local.claim_fds
        engines = EngineOutbox(node, self.local, self.mesh)
        self.completions = Completions(
            notify=engines.notify,
            apply=engines.apply,
            apply_bucket=engines.apply_bucket,
            verdict=engines.verdict,
            fence=self.dataplane.fence,
            metrics=self.metrics,
        )
        self.publishing = Publishing(
            node,
            self.dataplane.transport_to,
            self.local,
            self.mesh,
            self.registry,
            installed,
            self.metrics,
        )
        self.plans = PlanBook(
            node,
            incarnation,
            self.mesh,
            self.view,
            sessions,
            self.registry,
            self.dataplane.lanes,
            self.completions,
            self.publishing,
            self.dataplane.connect_soon,
            self.dataplane.authorize,
            installed,
            cfg.max_message_bytes,
            self.dataplane.peer_regions,
        )
        self.ranks = Ranks(
            self.registry,
            self.plans,
            self.publishing,
            self.completions,
            self.view,
            sessions,
            cfg.stall_timeout_s,
        )
        self.cluster = Cluster(
            self.view,
            self.mesh,
            self.member,
            lambda: cfg.coordinator or self.mesh.endpoint,
            cfg.heartbeat_timeout_s,
            sessions,
            self.plans,
            self.publishing,
            self.completions,
            self.dataplane,
            self.tasks,
            self.join,
            self._joined,
            lambda: self.status(),
        )
        self.status = StatusReport(
            node=node,
            version=weightwire.__version__,
            incarnation=incarnation,
            started=time.time(),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            mesh=self.mesh,
            cluster=self.view,
            sessions=sessions,
            registry=self.registry,
            plans=self.plans,
            publishing=self.publishing,
            completions=self.completions,
            dataplane=self.dataplane,
        )

    def member(self) -> Member:
        public = self.mesh.security.public_key
        return Member(
            node=self.node,
            endpoint=self.mesh.endpoint,
            incarnation=self.incarnation,
            transports=self.dataplane.endpoints(),
            public_key=public.decode() if public else "",
        )

    # --- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        cfg = self.cfg
        await self.dataplane.start(self.completions.on_imm, self.completions.admit)
        self.authenticator = start_authenticator(self.ctx, self.mesh.security)
        endpoint = self.mesh.bind(cfg.peer_bind, cfg.advertise_host)
        self.mesh.know(COORDINATOR, cfg.coordinator or endpoint, self.mesh.security.coordinator_key)
        if self.view.coordinator is None:
            self.join.attach(self.mesh.socket_to(COORDINATOR))
        self.local.bind(self.ctx)
        self._sweep()
        metrics_at = None
        if self.prometheus is not None:
            host, port = self.prometheus.serve(cfg.metrics_bind)
            metrics_at = f"http://{host}:{port}/metrics"
        ready = {
            "node": self.node,
            "peer_endpoint": endpoint,
            "local_socket": cfg.local_socket,
            "coordinator": cfg.is_coordinator,
            "transports": msgspec.to_builtins(self.dataplane.endpoints()),
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "metrics": metrics_at,
        }
        try:
            if cfg.ready_file:  # what it says is true once it exists: written before the log
                write_ready_file(cfg.ready_file, ready)
            log.info("daemon ready", **ready)
            # systemd hears READY once the node has joined (see PeerWelcome); until then, why
            self.notifier.waiting(self.join.waiting_for)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.mesh.serve(self.cluster.on_peer))
                tg.create_task(self.local.serve(self.ranks))
                tg.create_task(self._tick())
                if self.view.coordinator is None:
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
        self.publishing.abort_all("the daemon is shutting down", ErrorCode.PEER_LOST)
        await self.dataplane.close(self.cfg.shutdown_timeout_s)
        self.tasks.cancel()
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
        reload_keys(self.cfg, self.mesh, self.authenticator, self.view)

    def _joined(self, coordinator: str) -> None:
        self.notifier.ready(
            f"joined {coordinator}; serving {self.cfg.local_socket}; peers at {self.mesh.endpoint}"
        )

    def _local_ranks(self, job: str) -> set[tuple[str, int]]:
        trainers = {("trainer", r) for j, r in self.publishing.publishers if j == job}
        return trainers | {("engine", r) for j, r in self.completions.ranks if j == job}

    def _live_peers(self) -> int:
        timeout = self.cfg.heartbeat_timeout_s
        members = list(self.view.members)
        return sum(1 for m in members if m != self.node and self.mesh.alive(m, timeout))

    def _region_count(self) -> int:
        return len(self.registry.regions)

    # --- periodic work -------------------------------------------------------

    async def _tick(self) -> None:
        cfg = self.cfg
        last_status = 0.0
        last_sweep = time.monotonic()
        while True:
            now = time.monotonic()
            self.cluster.tick(now)
            for rc in self.completions.ranks.values():
                rc.expire(cfg.version_timeout_s)
            self.local.expire(cfg.session_timeout_s)
            self.registry.reap()
            self.version_log.flush()
            self.notifier.watchdog()
            if now - last_sweep >= 60.0:
                last_sweep = now
                self._sweep()
            if now - last_status >= 5.0:
                last_status = now
                joined = self.view.coordinator_name is not None
                if joined:
                    self.notifier.status(self.status.one_line())
                else:
                    self.notifier.waiting(self.join.waiting_for)
            await asyncio.sleep(cfg.heartbeat_interval_s)

    def _sweep(self) -> None:
        try:
            removed = sweep_stale(self.cfg.region_dir)
        except OSError as exc:
            log.warning("could not sweep region files", dir=self.cfg.region_dir, error=str(exc))
            return
        if removed:
            log.info("removed region files of exited ranks", files=len(removed))


class _Stop(Exception):
    pass


__all__ = ["Daemon"]
