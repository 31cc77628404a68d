"""The status document a daemon returns to `weightwire status` and tools."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.peer import StatusAnswer, StatusQuery

if TYPE_CHECKING:
    from .node import Daemon


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


def status(d: Daemon) -> dict[str, Any]:
    now = time.monotonic()
    return {
        "node": d.node,
        "version": d.version,
        "incarnation": d.incarnation,
        "uptime_s": round(time.time() - d.started, 1),
        "pid": os.getpid(),
        "rss_bytes": _rss_bytes(),
        "open_fds": _open_fds(),
        "peer_endpoint": d.mesh.endpoint,
        "coordinator": d.coordinator_name,
        "is_coordinator": d.coordinator is not None,
        "peers": [
            {
                "node": m.node,
                "endpoint": m.endpoint,
                "alive": m.node == d.node or d.mesh.alive(m.node, d.cfg.heartbeat_timeout_s),
                "last_seen_s": (
                    round(now - d.mesh.last_seen[m.node], 2) if m.node in d.mesh.last_seen else None
                ),
                "lost": m.node in d.lost,
            }
            for m in sorted(d.members.values(), key=lambda m: m.node)
        ],
        "sessions": [
            {"role": s.role, "rank": s.rank, "job": s.job, "pid": s.hello.pid}
            for s in d.local.sessions.values()
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
            for r in d.registry.regions.values()
        ],
        "plans": {job: p.plan_hash for job, p in d.plans.items()},
        "plan_problems": {job: e.message for job, e in d.plan_problems.items()},
        "publishing": [
            {"job": job, **pub.progress()} for (job, _), pub in sorted(d.publishers.items())
        ],
        "receiving": [
            {"job": job, **rc.progress()} for (job, _), rc in sorted(d.completions.ranks.items())
        ],
        "transports": {t.name: t.stats() for t in d.transports},
        "coordination": d.coordinator.status() if d.coordinator is not None else None,
    }


ASK_S = 3.0  # how long `status --cluster` waits for each daemon


async def cluster_status(d: Daemon) -> dict[str, Any]:
    """Every member's status, asked over the mesh at once (this node's, as it is); a daemon
    that does not answer within ASK_S is listed with why."""

    async def ask(node: str) -> dict[str, Any]:
        if node == d.node:
            return status(d)
        try:
            reply = await d.mesh.request(node, StatusQuery(), ASK_S)
        except WeightwireError as exc:
            return {"node": node, "error": exc.message}
        if not isinstance(reply, StatusAnswer):
            return {"node": node, "error": f"answered {type(reply).__name__}"}
        return dict(reply.body)

    names = sorted(set(d.members) | {d.node})
    answers = await asyncio.gather(*(ask(n) for n in names))
    return {
        "cluster": True,
        "asked": d.node,
        "coordinator": d.coordinator_name,
        "nodes": dict(zip(names, answers, strict=True)),
    }
