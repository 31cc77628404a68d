"""The processes of a `weightwire bench gpu` run: their environment, the daemon(s), and
the rank processes driven command by command."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from weightwire.harness.localcluster import LocalCluster
from weightwire.harness.ranks import Rank

from .errors import RunError

# NVLink multicast stays off in everything this starts (see the device notes)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def child_env(device: str) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    alloc = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc.replace(" ", ""):
        env.pop("PYTORCH_CUDA_ALLOC_CONF")  # CUDA IPC cannot share expandable segments
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


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
                env=child_env(self.device),
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


def rank_flags(
    args: Any, cfg_path: Path, trainers: int, engines: int, dist_store: Path
) -> list[str]:
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
        *(["--direct"] if getattr(args, "direct", False) else []),
        "--bucket-mb",
        str(args.bucket_mb),
        "--dist-store",
        str(dist_store),
        "--timeout",
        str(args.timeout),
    ]


def daemon_flags(args: Any) -> dict[str, str]:
    flags = {"version-timeout-s": str(args.timeout), "session-timeout-s": "30"}
    for item in args.daemon_flag or ():
        key, _, value = item.partition("=")
        flags[key] = value
    return flags


def start_cluster(args: Any, workdir: Path, replica: bool) -> LocalCluster:
    workdir.mkdir(parents=True, exist_ok=True)
    flags = daemon_flags(args)
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
