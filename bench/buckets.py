"""`weightwire bench buckets`: the daemon's fixed costs, per version and per bucket (CPU).

One real daemon on loopback, a trainer rank and an engine rank of this process on host
memory (tcp from the daemon to itself). Buckets are small, so that what is measured is
the daemon's handling of each `BucketReady` and of each `BeginVersion`, not bytes:

- begin: `PublishStats.begin_seconds` (publish call -> version accepted) and
  `begin_request_seconds` (the BeginVersion round trip), against a `Ping` round trip on
  the same connection (the baseline: what any request costs);
- per bucket: the daemon's CPU time (/proc) per bucket posted, at two bucket sizes (the
  difference is the bytes' share), and the wall time of a version per bucket;
- the daemon's first events in each version (`PublishResult.timeline`);
- `--profile FILE`: the daemon run under cProfile (its loop thread), the top functions
  by own time printed at the end.

Every version's bytes are checked at the engine. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

from .tcp import cpu_seconds

KiB = 1 << 10


def loop_seconds(pid: int) -> float:
    """CPU time of a process's main thread (the daemon's event loop) so far."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buckets", type=int, default=256, help="buckets per version")
    p.add_argument(
        "--bucket-kib", default="4,64", help="bucket sizes to compare (KiB, comma-separated)"
    )
    p.add_argument("--versions", type=int, default=20, help="measured versions per size")
    p.add_argument(
        "--staging-buckets",
        type=int,
        default=0,
        help="the trainer's ring (0: the whole send staged, no BucketsLanded per bucket, as "
        "with GPU slot counters; N: told of each landing)",
    )
    p.add_argument("--pings", type=int, default=200, help="Ping round trips (the baseline)")
    p.add_argument("--profile", metavar="FILE", help="run the daemon under cProfile into FILE")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _summary(xs: list[float], scale: float = 1e6) -> dict[str, float]:
    return {
        "p50": round(_pct(xs, 0.5) * scale, 1),
        "p90": round(_pct(xs, 0.9) * scale, 1),
        "min": round(min(xs) * scale, 1) if xs else 0.0,
    }


def measure(kib: int, args: argparse.Namespace, profile: str | None) -> dict[str, Any]:
    import torch

    from weightwire.client import Engine, Trainer
    from weightwire.harness.localcluster import LocalCluster
    from weightwire.protocol.local import Ping

    bucket = kib * KiB
    flags = {
        "bucket-bytes": str(bucket),
        "max-write-bytes": str(bucket),
        "session-timeout-s": "30",
    }
    python = ["-m", "cProfile", "-o", profile] if profile else []
    c = LocalCluster(hosts=1, insecure=True, extra=flags, python=python)
    c.start()
    out: dict[str, Any] = {"bucket_kib": kib, "staging_buckets": args.staging_buckets}
    try:
        cols = 256  # float32 rows of 1 KiB
        rows = args.buckets * bucket // (cols * 4)
        job = f"buckets-{kib}"
        dst = torch.zeros(rows, cols)
        eng = Engine(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=60)
        eng.register({"w": dst})
        w = torch.zeros(rows, cols)
        sock, slots = c.daemons[0].socket, args.staging_buckets
        with Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=slots) as tr:
            tr.register({"w": w})
            plan = tr.prepare()
            out["buckets"] = len(plan.buckets)
            pid = c.daemons[0].proc.pid
            pings = []
            for _ in range(args.pings):
                t = time.perf_counter()
                tr._conn.request(Ping())
                pings.append(time.perf_counter() - t)
            begins, requests, walls, cpus, prepings, loops = [], [], [], [], [], []
            timelines: list[dict[str, float]] = []
            for version in range(args.versions + 2):  # two warm-up versions
                w.fill_(float(version))
                cpu0, loop0 = cpu_seconds([pid]), loop_seconds(pid)
                t = time.perf_counter()
                tr._conn.request(Ping())  # the same moment's baseline: a request just before
                pre = time.perf_counter() - t
                t = time.perf_counter()
                stats = tr.publish(version)
                wall = time.perf_counter() - t
                eng.wait(version)
                cpu = cpu_seconds([pid]) - cpu0
                loops.append((loop_seconds(pid) - loop0) / len(plan.buckets))
                if not torch.equal(dst.view(torch.uint8), w.view(torch.uint8)):
                    raise RuntimeError(f"version {version}: the engine's bytes differ")
                if version < 2:
                    continue
                prepings.append(pre)
                begins.append(stats.begin_seconds)
                requests.append(stats.begin_request_seconds)
                walls.append(wall / len(plan.buckets))
                cpus.append(cpu / len(plan.buckets))
                timelines.append(stats.timeline)
        eng.close()
    finally:
        codes = c.stop()
    out["ping_us"] = _summary(pings)
    out["ping_before_publish_us"] = _summary(prepings)
    out["begin_us"] = _summary(begins)
    out["begin_request_us"] = _summary(requests)
    out["begin_request_over_ping"] = round(_pct(requests, 0.5) / _pct(pings, 0.5), 2)
    # /proc counts CPU time in ticks (10 ms): the measured versions' total, not a median
    out["daemon_cpu_us_per_bucket"] = round(sum(cpus) / len(cpus) * 1e6, 1)
    out["daemon_loop_cpu_us_per_bucket"] = round(sum(loops[2:]) / len(loops[2:]) * 1e6, 1)
    out["wall_us_per_bucket"] = round(statistics.median(walls) * 1e6, 1)
    keys = sorted({k for t in timelines for k in t}, key=lambda k: timelines[-1].get(k, 0))
    out["timeline_ms_p50"] = {
        k: round(statistics.median(t[k] for t in timelines if k in t) * 1e3, 3) for k in keys
    }
    out["daemon_exit"] = codes
    return out


def _top(profile: str, n: int = 20) -> list[str]:
    st = pstats.Stats(profile)
    rows = []
    for (file, line, fn), (_, calls, tt, ct, _) in sorted(
        st.stats.items(),  # type: ignore[attr-defined]
        key=lambda kv: kv[1][2],
        reverse=True,
    )[:n]:
        where = file.split("weightwire/")[-1] if "weightwire" in file else file.split("/")[-1]
        own, cum = tt * 1e3, ct * 1e3
        rows.append(f"{own:9.1f} ms own {cum:9.1f} ms cum {calls:8d}  {where}:{line} {fn}")
    return rows


def run(args: argparse.Namespace) -> int:
    results = []
    sizes = [int(k) for k in args.bucket_kib.split(",")]
    for i, kib in enumerate(sizes):
        profile = args.profile if args.profile and i == 0 else None
        results.append(measure(kib, args, profile))
    report: dict[str, Any] = {"runs": results}
    if len(results) >= 2:
        a, b = results[0], results[1]
        per_kib = (b["daemon_cpu_us_per_bucket"] - a["daemon_cpu_us_per_bucket"]) / (
            b["bucket_kib"] - a["bucket_kib"]
        )
        report["daemon_cpu_us_per_kib"] = round(per_kib, 3)
        report["daemon_cpu_us_per_bucket_fixed"] = round(
            a["daemon_cpu_us_per_bucket"] - per_kib * a["bucket_kib"], 1
        )
    if args.profile:
        report["profile_top"] = _top(args.profile)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    for r in results:
        print(
            f"{r['bucket_kib']:5d} KiB x {r['buckets']} buckets: daemon CPU "
            f"{r['daemon_cpu_us_per_bucket']} us/bucket (its loop thread "
            f"{r['daemon_loop_cpu_us_per_bucket']}), wall {r['wall_us_per_bucket']} us/bucket; "
            f"begin p50 {r['begin_us']['p50']} us (request {r['begin_request_us']['p50']} us, "
            f"{r['begin_request_over_ping']} x a ping of {r['ping_us']['p50']} us; a ping just "
            f"before publish {r['ping_before_publish_us']['p50']} us)"
        )
        print(f"      first events (ms after begin, p50): {r['timeline_ms_p50']}")
    if "daemon_cpu_us_per_bucket_fixed" in report:
        print(
            f"daemon CPU per bucket, fixed part: {report['daemon_cpu_us_per_bucket_fixed']} us "
            f"(+{report['daemon_cpu_us_per_kib']} us per KiB)"
        )
    for row in report.get("profile_top", []):
        print(row)
    return 0
