"""`weightwire status`: what a running daemon holds and is doing, as text (the fetching is
`weightwire.client.status`)."""

from __future__ import annotations

import json
from typing import Any


def _gb(n: object) -> str:
    return f"{int(n) / 1e9:.3f} GB" if isinstance(n, int | float) else "-"


def render(s: dict[str, Any]) -> str:
    lines = [
        f"node {s['node']}  (weightwired {s['version']}, pid {s['pid']}, up {s['uptime_s']} s, "
        f"rss {_gb(s['rss_bytes'])}, {s['open_fds']} fds)",
        f"  peer endpoint {s['peer_endpoint']}   coordinator {s['coordinator']}"
        + ("  [this node coordinates]" if s["is_coordinator"] else ""),
        "  peers:",
    ]
    for p in s["peers"]:
        state = "lost" if p["lost"] else "alive" if p["alive"] else "silent"
        lines.append(
            f"    {p['node']:<16} {p['endpoint']:<28} {state:<6} seen {p['last_seen_s']} s ago"
        )
    lines.append("  regions:")
    for r in s["regions"] or [
        {"id": "-", "purpose": "(none)", "kind": "", "bytes": 0, "owner": ""}
    ]:
        size = _gb(r["bytes"])
        lines.append(f"    #{r['id']:<4} {r['purpose']:<8} {r['kind']:<4} {size:>12}  {r['owner']}")
    for job, h in s["plans"].items():
        lines.append(f"  plan of job {job!r}: {h}")
    for job, problem in s["plan_problems"].items():
        lines.append(f"  plan of job {job!r} IMPOSSIBLE: {problem}")
    for job, why in s.get("plans_withdrawn", {}).items():  # ranks of the job left
        lines.append(f"  plan of job {job!r} WITHDRAWN: {why}")
    for p in s["publishing"]:
        frac = p["bytes_done"] / p["bytes_total"] if p["bytes_total"] else 0.0
        ring = p.get("staging_buckets", 0)
        staging = f"ring of {ring}" if ring else "whole send"
        lines.append(
            f"  trainer rank {p['rank']}: version {p['version']} {p['state']} "
            f"{frac:6.1%} of {_gb(p['bytes_total'])} "
            f"(buckets {p['buckets_posted']}/{p['buckets']}; "
            f"staging {_gb(p.get('staging_bytes', 0))}, {staging})"
        )
    for r in s["receiving"]:
        cur = ", ".join(f"v{i['version']} {i['fraction']:.1%}" for i in r["in_progress"]) or "idle"
        lines.append(
            f"  engine rank {r['rank']}: last complete v{r['last_complete']}, now {cur} "
            f"({r['expected_writes']} writes, {_gb(r['expected_bytes'])} per version)"
        )
    lines.append("  transports: " + json.dumps(s["transports"]))
    return "\n".join(lines)


def render_cluster(c: dict[str, Any]) -> str:
    """`status --cluster`: one line per daemon, then each job with its plan and the progress
    of the version in flight at every rank, cluster-wide."""
    nodes: dict[str, dict[str, Any]] = c["nodes"]
    lines = [f"cluster as seen from {c['asked']} (coordinator {c['coordinator']}):"]
    jobs: dict[str, list[str]] = {}
    for name, s in nodes.items():
        if "error" in s:
            lines.append(f"  {name:<16} NO ANSWER: {s['error']}")
            continue
        alive = sum(1 for p in s["peers"] if p["alive"] and p["node"] != name)
        ranks = ", ".join(f"{x['role']} {x['rank']} ({x['job']})" for x in s["sessions"]) or "-"
        lines.append(
            f"  {name:<16} weightwired {s['version']}, up {s['uptime_s']} s, {alive} live peers, "
            f"{len(s['regions'])} regions; ranks: {ranks}"
            + ("  [coordinator]" if s["is_coordinator"] else "")
        )
        for job, h in s["plans"].items():
            jobs.setdefault(job, []).append(f"    {name}: plan {h}")
        for job, problem in s["plan_problems"].items():
            jobs.setdefault(job, []).append(f"    {name}: plan IMPOSSIBLE: {problem}")
        for job, why in s.get("plans_withdrawn", {}).items():
            jobs.setdefault(job, []).append(f"    {name}: plan WITHDRAWN: {why}")
        for p in s["publishing"]:
            frac = p["bytes_done"] / p["bytes_total"] if p["bytes_total"] else 0.0
            jobs.setdefault(p["job"], []).append(
                f"    {name} trainer rank {p['rank']}: version {p['version']} {p['state']} "
                f"{frac:6.1%} of {_gb(p['bytes_total'])}"
            )
        for r in s["receiving"]:
            cur = ", ".join(f"v{i['version']} {i['fraction']:.1%}" for i in r["in_progress"])
            jobs.setdefault(r["job"], []).append(
                f"    {name} engine rank {r['rank']}: last complete v{r['last_complete']}"
                + (f", now {cur}" if cur else "")
            )
        coord = s.get("coordination") or {}
        for job, j in (coord.get("jobs") or {}).items():
            missing = j.get("missing") or []
            jobs.setdefault(job, []).insert(
                0,
                f"    coordinator: plan {j.get('plan')}"
                + (f", problem: {j['problem']}" if j.get("problem") else "")
                + (f" (plan {j['withdrawn']} withdrawn)" if j.get("withdrawn") else "")
                + (f", missing: {missing}" if missing else ""),
            )
    for job, rows in sorted(jobs.items()):
        lines.append(f"  job {job!r}:")
        lines.extend(rows)
    if not jobs:
        lines.append("  no jobs")
    return "\n".join(lines)
