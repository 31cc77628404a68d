"""The launcher of `weightwire bench gpu`: one daemon, one process per rank, the link
rates, every version through weightwire and through the broadcast baseline, verified.

Ranks: trainers 0..T-1 on GPUs 0..T-1, engines on GPUs T..T+E-1 (wrapped onto fewer GPUs
when there are not enough; then NCCL cannot run the baseline and it is skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightwire.cli.demo import Rank
from weightwire.cli.localcluster import LocalCluster

from . import chrome_trace, report
from . import model as M
from .text import render, version_line

# NVLink multicast stays off in everything this starts (see the device notes)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class RunError(RuntimeError):
    pass


class Interrupted(RunError):
    pass


class Budget:
    """--time-budget: stop measuring more versions (and start no more runs) when the next
    one would not finish in time, so the report is always written."""

    deadline: float | None = None
    run_deadline: float | None = None  # this run's share of what is left
    interrupted = False

    @classmethod
    def left(cls) -> float:
        return float("inf") if cls.deadline is None else cls.deadline - time.monotonic()

    @classmethod
    def run_left(cls) -> float:
        if cls.run_deadline is None:
            return cls.left()
        return min(cls.left(), cls.run_deadline - time.monotonic())


def _on_signal(signum: int, frame: Any) -> None:
    if Budget.interrupted:
        return  # already stopping: let the cleanup finish
    Budget.interrupted = True
    raise Interrupted(f"interrupted by signal {signum}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env(device: str) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    alloc = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc.replace(" ", ""):
        env.pop("PYTORCH_CUDA_ALLOC_CONF")  # CUDA IPC cannot share expandable segments
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _kind(args: Any) -> str:
    return "GPU" if args.device == "cuda" else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(
    device: str, pairs: list[tuple[int, int]], mb: int, reps: int, host: bool
) -> dict[str, Any]:
    """Device info and link rates, from a process of its own (it holds GPU memory)."""
    cmd = [sys.executable, "-m", "weightwire.bench.gpu.links", "--device", device]
    if pairs:
        cmd += ["--pairs", ",".join(f"{a}:{b}" for a, b in pairs), "--mb", str(mb)]
        cmd += ["--reps", str(reps)]
        if host:
            cmd.append("--host")
    else:
        cmd.append("--info-only")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(device))
    if out.returncode != 0:
        raise RunError(f"link measurement failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- sizing
def fit_layers(
    cfg: dict[str, Any],
    args: Any,
    trainers: int,
    engines: int,
    budget: int | None,
    host_budget: int | None = None,
) -> tuple[int, str]:
    """The layers to run: --layers N (`auto`: the config's), or fewer when the estimated
    peak of a rank on its GPU (or the CPU replica in /dev/shm) would not fit."""
    given = args.layers != "auto"
    layers = int(args.layers) if given else int(cfg["num_hidden_layers"])
    source = "--layers" if given else "the config's"
    if budget is None and host_budget is None:
        return layers, source
    full = args.trainer_layout == "full"

    def fits(n: int) -> bool:
        s = M.sizes({**cfg, "num_hidden_layers": n}, engines, args.dest)
        t, e = M.peak_bytes(
            s,
            trainers,
            engines,
            full,
            args.bucket_mb << 20,
            not args.no_baseline and not args.replica,
        )
        if budget is not None and max(t, e) > budget:
            return False
        return host_budget is None or sum(s.engine_bytes) <= host_budget

    if fits(layers):
        return layers, f"{source}, fits"
    lo, hi = 0, layers  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        where = "the GPU memory" if host_budget is None else "the GPU memory or /dev/shm"
        raise RunError(f"not even one layer of this model fits {where}")
    return lo, f"reduced from {layers} ({source}): the estimated peak of {layers} does not fit"


# --------------------------------------------------------------------------- ranks
class Group:
    """The rank processes of one run, driven command by command."""

    def __init__(self, workdir: Path, device: str) -> None:
        self.workdir = workdir
        self.device = device
        self.trainers: list[Rank] = []
        self.engines: list[Rank] = []
        self.logs: dict[str, Path] = {}

    def spawn(self, role: str, rank: int, flags: list[str]) -> Rank:
        name = f"{role}-{rank}"
        log_path = self.workdir / f"{name}.log"
        self.logs[name] = log_path
        cmd = [sys.executable, "-m", "weightwire.bench.gpu.rank", role, "--rank", str(rank), *flags]
        with open(log_path, "ab") as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=_env(self.device),
            )
        r = Rank(role, rank, proc)
        r.start_reader()
        (self.trainers if role == "trainer" else self.engines).append(r)
        return r

    @property
    def all(self) -> list[Rank]:
        return self.trainers + self.engines

    def tail(self, r: Rank, lines: int = 30) -> str:
        path = self.logs.get(f"{r.role}-{r.rank}")
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def next(self, r: Rank, timeout_s: float) -> dict[str, Any]:
        try:
            ev = r.next(timeout_s)
        except RuntimeError as exc:
            raise RunError(f"{exc}\n--- {r.role} {r.rank} log tail:\n{self.tail(r)}") from None
        if ev.get("event") == "error":
            raise RunError(f"{r.role} rank {r.rank}: {ev.get('cmd')} v{ev.get('version')}: {ev}")
        return ev

    def step(
        self, ranks: list[Rank], cmd: str, version: int, timeout_s: float
    ) -> list[dict[str, Any]]:
        for r in ranks:
            r.send(cmd=cmd, version=version)
        return [self.next(r, timeout_s) for r in ranks]

    def close(self, wait_s: float = 60) -> None:
        for r in self.all:
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                r.send(cmd="quit")
        for r in self.all:
            try:
                r.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait(10)


def _rank_flags(args: Any, cfg_path: Path, trainers: int, engines: int, port: int) -> list[str]:
    return [
        "--trainers",
        str(trainers),
        "--engines",
        str(engines),
        "--config",
        str(cfg_path),
        "--dest",
        args.dest,
        "--device",
        args.device,
        "--trainer-layout",
        args.trainer_layout,
        *(["--zero-copy"] if args.zero_copy else []),
        "--bucket-mb",
        str(args.bucket_mb),
        "--dist-port",
        str(port),
        "--timeout",
        str(args.timeout),
    ]


def _daemon_flags(args: Any) -> dict[str, str]:
    flags = {"version-timeout-s": str(args.timeout), "session-timeout-s": "30"}
    for item in args.daemon_flag or ():
        key, _, value = item.partition("=")
        flags[key] = value
    return flags


# --------------------------------------------------------------------------- one run
def placement(text: str, trainers: int, engines: int, n: int) -> tuple[list[int], list[int]]:
    """--place "0,0:1,1": the trainer ranks' GPUs, a colon, the engine ranks' GPUs."""
    try:
        t_text, e_text = text.split(":")
        tg = [int(x) for x in t_text.split(",")]
        eg = [int(x) for x in e_text.split(",")]
    except ValueError:
        raise SystemExit(
            f"--place {text!r}: expected trainer GPUs:engine GPUs, e.g. 0,0:1,1"
        ) from None
    if len(tg) != trainers or len(eg) != engines or not all(0 <= g < n for g in tg + eg):
        raise SystemExit(
            f"--place {text!r}: needs {trainers} trainer and {engines} engine GPU ordinals "
            f"below {n}"
        )
    return tg, eg


def run_pair(
    args: Any,
    base_cfg: dict[str, Any],
    trainers: int,
    engines: int,
    info: dict[str, Any],
    workdir: Path,
) -> dict[str, Any]:
    name = f"{trainers}x{engines}"
    rec: dict[str, Any] = {"pair": name, "trainers": trainers, "engines": engines, "mode": "pair"}
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
    return _run(args, cfg, rec, tg, eg, baseline, workdir / name, replica=False)


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


def _start_cluster(args: Any, workdir: Path, replica: bool) -> LocalCluster:
    workdir.mkdir(parents=True, exist_ok=True)
    flags = _daemon_flags(args)
    if not replica:
        c = LocalCluster(hosts=1, extra=flags, workdir=workdir)
        c.start()
        c.wait_joined()
        return c
    # the engines' daemon (GPU destinations, coordinator) and the trainer's daemon with
    # cuda off: the replica goes over tcp and lands through the engine daemon's bounce
    c = LocalCluster(hosts=2, extra=flags, workdir=workdir)
    for host in range(2):
        c.keys(f"host{host}")
    try:
        c.start_daemon(0, coordinator=True)
        c.start_daemon(1, flags={"cuda": "off"})
        c.wait_joined()
    except BaseException:
        c.stop()
        raise
    return c


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
        cluster = _start_cluster(args, workdir, replica)
        port = _free_port()
        common = _rank_flags(args, cfg_path, T, E, port)
        if cuda and baseline:
            common.append("--nccl")
        if not baseline:
            common.append("--no-baseline")
        tsock = cluster.daemons[1 if replica else 0].socket
        esock = cluster.daemons[0].socket
        staging = "cpu" if replica else args.staging
        for r in range(T):
            group.spawn(
                "trainer",
                r,
                [*common, "--gpu", str(tg[r]), "--socket", tsock, "--staging", staging],
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
        group.close(15 if Budget.interrupted else 60)
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
    log(f"[{pair}] {version_line(out)}")
    return out


def _transports(cluster: LocalCluster) -> dict[str, Any]:
    from weightwire.cli.status import fetch

    out = {}
    for d in cluster.daemons:
        with contextlib.suppress(Exception):
            out[d.node] = fetch(d.socket)["transports"]
    return out


# --------------------------------------------------------------------------- main
def main(args: Any) -> int:
    os.environ.update(NO_MULTICAST)
    if args.time_budget:
        Budget.deadline = time.monotonic() + args.time_budget
    signal.signal(signal.SIGTERM, _on_signal)
    base_cfg = M.load_config(args.model, None, args.set or ())
    if args.layers != "auto":
        base_cfg["num_hidden_layers"] = int(args.layers)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ww-bench-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = probe(args.device, [], 0, 0, False)
    gpus = info["devices"]["gpus"]
    if args.device == "cuda" and not gpus:
        log("weightwire bench gpu: no GPU visible (use --device cpu to exercise the program)")
        return 2
    result: dict[str, Any] = {
        "benchmark": "weightwire bench gpu",
        "device": args.device,
        "gpus": [g["name"] for g in gpus],
        "device_name": gpus[0]["name"] if gpus else "cpu",
        "torch": info["devices"]["torch"],
        "cuda": info["devices"]["cuda"],
        "nccl": info["devices"].get("nccl"),
        "model": {
            "config": str(args.model),
            "architecture": (base_cfg.get("architectures") or ["?"])[0],
            "layers_in_config": int(base_cfg["num_hidden_layers"]),
            "overrides": list(args.set or ()),
        },
        "dest": args.dest,
        "trainer_layout": args.trainer_layout,
        "versions": args.versions,
        "workdir": str(workdir),
        "runs": [],
    }
    log(
        f"weightwire bench gpu on {args.device}: "
        + (", ".join(f"GPU{g['index']} {g['name']}" for g in gpus) or "no GPU (CPU run)")
    )
    jobs: list[tuple[dict[str, Any], Any]] = []
    if args.replica:
        head = {"pair": "1x1 replica", "mode": "replica", "trainers": 1, "engines": 1}
        jobs.append((head, lambda: run_replica(args, base_cfg, info, workdir)))
    else:
        for pair in filter(None, args.pairs.split(",")):
            t, _, e = pair.lower().partition("x")
            head = {"pair": f"{t}x{e}", "mode": "pair", "trainers": int(t), "engines": int(e)}
            jobs.append(
                (head, lambda t=int(t), e=int(e): run_pair(args, base_cfg, t, e, info, workdir))
            )
    for i, (head, job) in enumerate(jobs):
        if Budget.deadline is not None:
            Budget.run_deadline = time.monotonic() + Budget.left() / (len(jobs) - i)
        if Budget.interrupted or Budget.left() < 45:
            why = "interrupted" if Budget.interrupted else "--time-budget spent"
            result["runs"].append({**head, "error": f"not run: {why}"})
            continue
        try:
            result["runs"].append(job())
        except Interrupted as exc:
            result["runs"].append({**head, "error": str(exc)})
    report.finish(result)
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace.trace(result)))
        log(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    text = render(result)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(result))
    else:
        print(text)
    return 0 if result["ok"] else 1
