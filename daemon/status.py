"""The status document a daemon returns to `weightwire status` and tools."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.peer import StatusAnswer, StatusQuery

from .completions import Completions
from .dataplane import DataPlane
from .membership import Membership
from .peers import PeerMesh
from .plans import PlanBook
from .publishing import Publishing
from .regions import RegionRegistry
from .sessions import Session


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


ASK_S = 3.0  # how long `status --cluster` waits for each daemon


@dataclass(frozen=True)
class StatusReport:
    """The parts the status document is read from (node.py wires them)."""

    node: str
    version: str
    incarnation: str
    started: float  # wall clock
    heartbeat_timeout_s: float
    mesh: PeerMesh
    cluster: Membership
    sessions: Mapping[bytes, Session]
    registry: RegionRegistry
    plans: PlanBook
    publishing: Publishing
    completions: Completions
    dataplane: DataPlane

    def one_line(self) -> str:
        timeout = self.heartbeat_timeout_s
        live = sum(1 for m in self.cluster.members if m == self.node or self.mesh.alive(m, timeout))
        return (
            f"{len(self.sessions)} ranks, {len(self.registry.regions)} regions, "
            f"{live} peers, {self.publishing.busy()} publishing, "
            f"coordinator {self.cluster.coordinator_name or '-'}"
        )

    def __call__(self) -> dict[str, Any]:
        now = time.monotonic()
        mesh, cluster, coordinator = self.mesh, self.cluster, self.cluster.coordinator
        return {
            "node": self.node,
            "version": self.version,
            "incarnation": self.incarnation,
            "uptime_s": round(time.time() - self.started, 1),
            "pid": os.getpid(),
            "rss_bytes": _rss_bytes(),
            "open_fds": _open_fds(),
            "peer_endpoint": mesh.endpoint,
            "coordinator": cluster.coordinator_name,
            "is_coordinator": coordinator is not None,
            "peers": [
                {
                    "node": m.node,
                    "endpoint": m.endpoint,
                    "alive": m.node == self.node or mesh.alive(m.node, self.heartbeat_timeout_s),
                    "last_seen_s": (
                        round(now - mesh.last_seen[m.node], 2) if m.node in mesh.last_seen else None
                    ),
                    "lost": m.node in cluster.lost,
                }
                for m in sorted(cluster.members.values(), key=lambda m: m.node)
            ],
            "sessions": [
                {"role": s.role, "rank": s.rank, "job": s.job, "pid": s.hello.pid}
                for s in self.sessions.values()
                if s.role != "admin"  # `weightwire status` itself
            ],
            "regions": [
                {
                    "id": r.local.id,
                    "purpose": r.purpose,
                    "kind": r.local.kind,
                    "bytes": r.local.length,
                    "owner": r.local.owner,
                }
                for r in self.registry.regions.values()
            ],
            "plans": {job: p.plan_hash for job, p in self.plans.plans.items()},
            "plan_problems": {job: e.message for job, e in self.plans.problems.items()},
            "plan_waits": self.plans.waits(),  # requests waiting for a plan to change
            "plans_withdrawn": dict(self.plans.withdrawn),  # ranks of the job left: why
            "rank_problems": {  # engine ranks refused alone (an elastic replica's claimant)
                f"{job} engine rank {rank}": e.message
                for (job, rank), e in self.plans.rank_problems.items()
            },
            "publishing": self.publishing.progress(),
            "receiving": [
                {"job": job, **rc.progress()}
                for (job, _), rc in sorted(self.completions.ranks.items())
            ],
            "transports": self.dataplane.stats(),
            "coordination": coordinator.status() if coordinator is not None else None,
        }

    async def whole_cluster(self) -> dict[str, Any]:
        """Every member's status, asked over the mesh at once (this node's, as it is); a
        daemon that does not answer within ASK_S is listed with why."""

        async def ask(node: str) -> dict[str, Any]:
            if node == self.node:
                return self()
            try:
                reply = await self.mesh.request(node, StatusQuery(), ASK_S)
            except WeightwireError as exc:
                return {"node": node, "error": exc.message}
            if not isinstance(reply, StatusAnswer):
                return {"node": node, "error": f"answered {type(reply).__name__}"}
            return dict(reply.body)

        names = sorted(set(self.cluster.members) | {self.node})
        answers = await asyncio.gather(*(ask(n) for n in names))
        return {
            "cluster": True,
            "asked": self.node,
            "coordinator": self.cluster.coordinator_name,
            "nodes": dict(zip(names, answers, strict=True)),
        }
