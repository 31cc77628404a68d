"""One `weightwire bench gpu` run: its link rates, daemon(s) and rank processes, every
version through weightwire and through the broadcast baseline, verified.

Ranks: trainers 0..T-1 on GPUs 0..T-1, engines on GPUs T..T+E-1 (wrapped onto fewer GPUs
when there are not enough; then NCCL cannot run the baseline and it is skipped).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightwire.harness.localcluster import LocalCluster

from . import model as M
from . import report, text
from .budget import Budget
from .errors import RunError
from .probe import probe
from .processes import Group, rank_flags, start_cluster
from .sizing import fit_layers, placement


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _kind(args: Any) -> str:
    return "GPU" if args.device == "cuda" else "cpu"


def run_pair(
    args: Any,
    base_cfg: dict[str, Any],
    trainers: int,
    engines: int,
    info: dict[str, Any],
    workdir: Path,
    ring: int = 4,
    name: str = "",
    slot_wait: str = "",
) -> dict[str, Any]:
    name = name or f"{trainers}x{engines}"
    rec: dict[str, Any] = {"pair": name, "trainers": trainers, "engines": engines, "mode": "pair"}
    rec["staging_buckets"] = ring
    if slot_wait:
        rec["slot_wait"] = slot_wait
    cuda = args.device == "cuda"
    n = len(info["devices"]["gpus"]) if cuda else trainers + engines
    if cuda and n == 0:
        rec["error"] = "no GPU visible"
        return rec
    tg = [i % n for i in range(trainers)]
    eg = [(trainers + e) % n for e in range(engines)]
    if args.place:
        tg, eg = placement(args.place, trainers, engines, n)
    shared = len(set(tg + eg)) < trainers + engines
    baseline = not args.no_baseline
    if cuda and shared and baseline:
        baseline = False
        rec["baseline_skipped"] = (
            f"{trainers + engines} ranks on {n} GPU(s): NCCL needs one GPU per rank"
        )
    rec["gpus"] = {"trainers": tg, "engines": eg, "shared": shared, "kind": _kind(args)}
    budget = None
    if cuda:
        budget = int(0.92 * min(info["devices"]["gpus"][g]["total"] for g in set(tg + eg)))
        if shared:
            budget //= max((tg + eg).count(g) for g in set(tg + eg))
    layers, why = fit_layers(base_cfg, args, trainers, engines, budget)
    cfg = {**base_cfg, "num_hidden_layers": layers}
    rec["layers"], rec["layers_why"] = layers, why
    return _run(args, cfg, rec, tg, eg, baseline, workdir / name.replace(" ", "-"), replica=False)


def run_replica(
    args: Any, base_cfg: dict[str, Any], info: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    rec: dict[str, Any] = {"pair": "1x1 replica", "trainers": 1, "engines": 1, "mode": "replica"}
    cuda = args.device == "cuda"
    n = len(info["devices"]["gpus"]) if cuda else 2
    if cuda and n == 0:
        rec["error"] = "no GPU visible"
        return rec
    tg, eg = [0], [1 % n]
    rec["gpus"] = {"trainers": tg, "engines": eg, "shared": tg == eg, "kind": _kind(args)}
    budget = None
    if cuda:
        budget = int(0.92 * min(info["devices"]["gpus"][g]["total"] for g in set(tg + eg)))
        if tg == eg:
            budget //= 2
    shm = shutil.disk_usage("/dev/shm").free
    layers, why = fit_layers(base_cfg, args, 1, 1, budget, host_budget=int(0.8 * shm))
    cfg = {**base_cfg, "num_hidden_layers": layers}
    rec["layers"], rec["layers_why"] = layers, why
    rec["shm_free"] = shm
    return _run(args, cfg, rec, tg, eg, False, workdir / "replica", replica=True)


def _run(
    args: Any,
    cfg: dict[str, Any],
    rec: dict[str, Any],
    tg: list[int],
    eg: list[int],
    baseline: bool,
    workdir: Path,
    replica: bool,
) -> dict[str, Any]:
    T, E = len(tg), len(eg)
    cuda = args.device == "cuda"
    workdir.mkdir(parents=True, exist_ok=True)
    rec["workdir"] = str(workdir)
    rec["baseline"] = baseline
    cfg_path = workdir / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    s = M.sizes(cfg, E, args.dest)
    rec["model"] = {
        "layers": s.layers,
        "hf_tensors": s.hf_tensors,
        "hf_bytes": s.hf_bytes,
        "engine_bytes": s.engine_bytes,
    }
    pairs = sorted({(a, b) for a in tg for b in eg})
    log(f"[{rec['pair']}] measuring link rates {', '.join(f'{a}->{b}' for a, b in pairs)}")
    try:
        rec["link_rates"] = probe(args.device, pairs, args.link_mb, args.link_reps, host=replica)[
            "links"
        ]
    except (RunError, subprocess.TimeoutExpired) as exc:
        rec["error"] = f"link measurement: {exc}"
        return rec
    log(
        f"[{rec['pair']}] {s.layers} layers, {s.hf_tensors} HF tensors, "
        f"{s.hf_bytes / 1e9:.2f} GB; starting the daemon(s) and {T + E} ranks"
    )
    cluster: LocalCluster | None = None
    group = Group(workdir, args.device)
    versions: list[dict[str, Any]] = []
    rec["versions"] = versions
    try:
        cluster = start_cluster(args, workdir, replica)
        store = (workdir / f"dist-store-{rec['pair']}-{time.time_ns()}").resolve()
        common = rank_flags(args, cfg_path, T, E, store)
        if cuda and baseline:
            common.append("--nccl")
        if not baseline:
            common.append("--no-baseline")
        tsock = cluster.daemons[1 if replica else 0].socket
        esock = cluster.daemons[0].socket
        staging = "cpu" if replica else args.staging
        ring = rec.get("staging_buckets", int(str(args.staging_buckets).split(",")[0]))
        for r in range(T):
            group.spawn(
                "trainer",
                r,
                [
                    *common,
                    *("--gpu", str(tg[r]), "--socket", tsock, "--staging", staging),
                    *("--staging-buckets", str(ring)),
                    *(("--slot-wait", rec["slot_wait"]) if rec.get("slot_wait") else ()),
                ],
            )
        for e in range(E):
            group.spawn("engine", e, [*common, "--gpu", str(eg[e]), "--socket", esock])
        t0 = time.monotonic()
        ready = [group.next(r, args.timeout) for r in group.all]
        rec["setup_s"] = time.monotonic() - t0
        rec["trainer_plans"] = [ev for ev in ready if ev["role"] == "trainer"]
        rec["engine_info"] = [ev for ev in ready if ev["role"] == "engine"]
        log(f"[{rec['pair']}] ranks ready in {rec['setup_s']:.1f} s; plan: " + _plan_line(rec))
        for v in range(args.versions + 1):
            t1 = time.monotonic()
            versions.append(_version(args, group, v, baseline, rec["pair"]))
            took = time.monotonic() - t1
            if v < args.versions and Budget.run_left() < 1.5 * took + 20:
                rec["cut"] = (
                    f"stopped after version {v} of {args.versions}: the next would overrun "
                    f"--time-budget"
                )
                log(f"[{rec['pair']}] {rec['cut']}")
                break
        rec["transports"] = _transports(cluster)
    except (RunError, RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        rec["error"] = str(exc) + _hint(str(exc), args)
        log(f"[{rec['pair']}] FAILED: {exc}")
    finally:
        # ranks of a failed run may wait in a collective for one that is gone: no long goodbye
        group.close(5 if "error" in rec else 15 if Budget.interrupted else 60)
        if cluster is not None:
            rec["daemon_exit_codes"] = cluster.stop()
    return report.summarize(rec)


def _hint(message: str, args: Any) -> str:
    if "FP8" in message and "whole" in message and args.trainer_layout == "fsdp":
        return (
            "\n(FP8 tiles must each come whole from one trainer rank: these FSDP shards cut "
            "some 128x128 tiles; --trainer-layout full gives every trainer whole tensors)"
        )
    return ""


def _plan_line(rec: dict[str, Any]) -> str:
    parts = []
    for p in rec["trainer_plans"]:
        parts.append(
            f"trainer {p['rank']}: {p['bytes'] / 1e9:.2f} GB in {p['writes']} writes, "
            f"{p['buckets']} buckets, {p['packs']} packs"
        )
    return "; ".join(parts)


def _version(args: Any, group: Group, v: int, baseline: bool, pair: str) -> dict[str, Any]:
    out: dict[str, Any] = {"version": v, "warmup": v == 0}
    g = group.step(group.trainers, "gen", v, args.timeout)
    out["gen_s"] = max(ev["seconds"] for ev in g)
    ww = group.step(group.all, "ww", v, args.timeout)
    out["ww"] = {"trainers": ww[: len(group.trainers)], "engines": ww[len(group.trainers) :]}
    ver = group.step(group.engines, "verify", v, args.timeout)
    out["ww_verify"] = ver
    if baseline:
        b = group.step(group.all, "base", v, args.timeout)
        out["base"] = {"trainers": b[: len(group.trainers)], "engines": b[len(group.trainers) :]}
        out["base_verify"] = group.step(group.engines, "verify", v, args.timeout)
    report.version_summary(out)
    log(f"[{pair}] {text.version_line(out)}")
    return out


def _transports(cluster: LocalCluster) -> dict[str, Any]:
    from weightwire.client.status import fetch

    out = {}
    for d in cluster.daemons:
        with contextlib.suppress(Exception):
            out[d.node] = fetch(d.socket)["transports"]
    return out
