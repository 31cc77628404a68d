"""A cluster of real weightwired processes on this machine, for the demo, tests and benchmarks.

Hosts are either loopback (every daemon on 127.0.0.1) or network namespaces with
their own addresses. Ports are bound as 0 and read back from each daemon's ready file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from . import netns


@dataclass
class DaemonProc:
    node: str
    host: int
    address: str
    socket: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, object] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return str(self.ready["peer_endpoint"])

    def logs(self) -> list[dict[str, object]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def daemon_argv(args: dict[str, str]) -> list[str]:
    """weightwired flags: `--key=value` (a Z85 CURVE key may start with '-', which argparse
    would take for a flag if it came as a word of its own), or `--key` for "" (a switch)."""
    return [f"--{k}" if v == "" else f"--{k}={v}" for k, v in args.items()]


@dataclass
class LocalCluster:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    hosts: int = 2
    use_netns: bool = False
    insecure: bool = False  # plaintext peer sockets; by default every daemon gets CURVE keys
    extra: dict[str, str] = field(default_factory=dict)  # more daemon flags, for every daemon
    metrics: bool = False  # every daemon serves Prometheus metrics on its address, any port
    python: list[str] = field(default_factory=list)  # interpreter options before `-m` (a profiler)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="weightwire-")))
    daemons: list[DaemonProc] = field(default_factory=list)
    net: netns.Hosts | None = None

    def address(self, host: int) -> str:
        return self.net.addresses[host] if self.net else "127.0.0.1"

    def prefix(self, host: int) -> list[str]:
        return self.net.prefix(host) if self.net else []

    def keys(self, node: str) -> dict[str, str]:
        """CURVE flags for a daemon: its own key pair, trusting every key made so far."""
        from weightwire.daemon.security import keygen

        if self.insecure:
            return {"insecure": ""}
        public_dir = self.workdir / "keys" / "public"
        secret_dir = self.workdir / "keys" / node
        if not (secret_dir / f"{node}.key_secret").exists():
            public, _ = keygen(str(secret_dir), node)
            public_dir.mkdir(parents=True, exist_ok=True)
            (public_dir / public.name).write_bytes(public.read_bytes())
        return {
            "curve-secret-key-file": str(secret_dir / f"{node}.key_secret"),
            "curve-allowed-keys-dir": str(public_dir),
        }

    def coordinator_key(self) -> str:
        import zmq.auth

        public, _ = zmq.auth.load_certificate(str(self.workdir / "keys" / "public" / "host0.key"))
        return public.decode()

    def start(self) -> LocalCluster:
        if self.use_netns:
            self.net = netns.Hosts(self.hosts)
        if not self.insecure:
            for host in range(self.hosts):
                self.keys(f"host{host}")
        coordinator = self.start_daemon(0, coordinator=True)
        for host in range(1, self.hosts):
            self.start_daemon(host, coordinator_endpoint=coordinator.endpoint)
        return self

    def start_daemon(
        self,
        host: int,
        *,
        coordinator: bool = False,
        coordinator_endpoint: str = "",
        node: str | None = None,
        flags: dict[str, str] | None = None,
        peer_port: int = 0,
    ) -> DaemonProc:
        node = node or f"host{host}"
        addr = self.address(host)
        sock = str(self.workdir / f"{node}.sock")
        ready = self.workdir / f"{node}.ready.json"
        ready.unlink(missing_ok=True)
        args = {
            "node": node,
            "local-socket": sock,
            "peer-bind": f"tcp://{addr}:{peer_port}",
            "advertise-host": addr,
            "tcp-bind": addr,
            "ready-file": str(ready),
            **({"metrics-bind": f"{addr}:0"} if self.metrics else {}),
            **self.keys(node),
            **self.extra,
            **(flags or {}),
        }
        if coordinator:
            args["is-coordinator"] = ""
        else:
            args["coordinator"] = coordinator_endpoint or self.daemons[0].endpoint
            if not self.insecure and "insecure" not in args:
                args["coordinator-public-key"] = self.coordinator_key()
        cmd = [
            *self.prefix(host),
            sys.executable,
            *self.python,
            "-m",
            "weightwire.daemon",
            *daemon_argv(args),
        ]
        log_path = self.workdir / f"{node}.log"
        log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - the daemon owns it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        d = DaemonProc(node, host, addr, sock, proc, log_path)
        # a daemon's start is imports, mostly: seconds, but far more in an emulated VM
        # (the Soft-RoCE tests' QEMU without KVM) on a loaded machine
        wait_s = float(os.environ.get("WEIGHTWIRE_TEST_DAEMON_READY_S", "30"))
        deadline = time.monotonic() + wait_s
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"daemon {node} exited ({proc.returncode}):\n{log_path.read_text()}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(
                    f"daemon {node} not ready in {wait_s:.0f} s:\n{log_path.read_text()}"
                )
            time.sleep(0.05)
        d.ready = json.loads(ready.read_text())
        existing = [i for i, x in enumerate(self.daemons) if x.node == node]
        if existing:
            self.daemons[existing[0]] = d
        else:
            self.daemons.append(d)
        return d

    def daemon(self, node: str) -> DaemonProc:
        return next(d for d in self.daemons if d.node == node)

    def wait_joined(self, timeout_s: float = 20.0) -> None:
        """Until the coordinator counts every daemon as a member."""
        from weightwire.client.status import fetch

        deadline = time.monotonic() + timeout_s
        want = {d.node for d in self.daemons if d.proc.poll() is None}
        while time.monotonic() < deadline:
            coord = fetch(self.daemons[0].socket).get("coordination") or {}
            if want <= set(coord.get("members", [])):  # type: ignore[union-attr]
                return
            time.sleep(0.1)
        raise RuntimeError(f"daemons {sorted(want)} did not all join in {timeout_s} s")

    def rank_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    def stop(self, timeout_s: float = 15.0) -> list[int]:
        """SIGTERM every daemon; returns their exit codes (killed ones count as -9)."""
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        codes = []
        for d in self.daemons:
            try:
                codes.append(d.proc.wait(timeout_s))
            except subprocess.TimeoutExpired:
                d.proc.kill()
                codes.append(-9)
        if self.net is not None:
            self.net.close()
        return codes

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
