"""The service: unit files verify, the example config loads, and the daemon speaks systemd's
notify protocol (READY, STATUS, WATCHDOG, STOPPING) to a real NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from weightwire.daemon.config import load

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "weightwired.service").read_text()
    exe = shutil.which("weightwired") or str(Path(sys.executable).parent / "weightwired")
    path = tmp_path / "weightwired.service"
    path.write_text(unit.replace("/usr/local/bin/weightwired", exe))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "LimitMEMLOCK=infinity",
        "RuntimeDirectory=weightwire",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
    ):
        assert needle in unit


def test_example_config_loads() -> None:
    cfg = load(str(ROOT / "systemd" / "weightwired.toml"), {})
    assert cfg.local_socket == "/run/weightwire/weightwired.sock" and cfg.socket_mode == 0o660
    assert cfg.coordinator.startswith("tcp://") and cfg.transport == "auto"
    for f in ("weightwire.sysusers.conf", "weightwire.tmpfiles.conf"):
        assert "weightwire" in (ROOT / "systemd" / f).read_text()


@contextmanager
def notifying_daemon(
    tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen[bytes], socket.socket]]:
    """A daemon process (insecure, on loopback, with `flags`) whose NOTIFY_SOCKET (and a
    1 s watchdog) is the datagram socket yielded with it; killed if still running after."""
    notify = tmp_path / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify))
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightwire.daemon",
            "--insecure",
            "--local-socket",
            str(tmp_path / "d.sock"),
            "--peer-bind",
            "tcp://127.0.0.1:0",
            "--tcp-bind",
            "127.0.0.1",
            *flags,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield proc, sink
    finally:
        if proc.poll() is None:
            proc.kill()
        sink.close()


def test_daemon_speaks_sd_notify(tmp_path: Path) -> None:
    with notifying_daemon(
        tmp_path, "--is-coordinator", "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1"
    ) as (proc, sink):
        sink.settimeout(10)
        seen: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
            any("READY=1" in m for m in seen) and sum("WATCHDOG=1" in m for m in seen) >= 3
        ):
            seen.append(sink.recv(4096).decode())
        assert any("READY=1" in m and "STATUS=" in m for m in seen), seen
        assert sum("WATCHDOG=1" in m for m in seen) >= 3, seen
        ready_at = next(i for i, m in enumerate(seen) if "READY=1" in m)
        assert not any("EXTEND_TIMEOUT_USEC" in m for m in seen[ready_at:]), seen
        proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sink.recv(4096).decode())
        assert proc.wait(20) == 0


def test_a_node_waiting_for_its_coordinator_extends_the_start_timeout(tmp_path: Path) -> None:
    """READY waits for the join; until then each STATUS carries EXTEND_TIMEOUT_USEC, so
    TimeoutStartSec does not kill a node whose coordinator is not up yet."""
    with socket.socket() as s:  # a port where no coordinator listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with notifying_daemon(tmp_path, "--coordinator", f"tcp://127.0.0.1:{port}") as (proc, sink):
        sink.settimeout(15)
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum("EXTEND" in m for m in seen) < 3:
            seen.append(sink.recv(4096).decode())
        extends = [m for m in seen if "EXTEND_TIMEOUT_USEC=" in m]
        assert len(extends) >= 3, seen  # at start, then with every STATUS tick (5 s)
        for m in extends:
            fields = dict(line.split("=", 1) for line in m.splitlines())
            assert int(fields["EXTEND_TIMEOUT_USEC"]) >= 10_000_000, m  # > the 5 s tick
            assert fields["STATUS"].startswith("waiting to join the coordinator"), m
        assert not any("READY=1" in m for m in seen), seen
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_exposure_is_low_and_a_bad_configuration_is_not_restarted(tmp_path: Path) -> None:
    """systemd's own security analysis of the unit: 5.8 (MEDIUM) before the capability
    bounding set, tunables, mounts and system call deny-list, 2.3 now. A configuration that
    cannot be parsed exits with status 2, which the unit does not restart."""
    path = tmp_path / "weightwired.service"
    path.write_text((ROOT / "systemd" / "weightwired.service").read_text())
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    exposure = float(out.stdout.split("Overall exposure level for")[1].split(":")[1].split()[0])
    assert exposure <= 3.0, out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("stall_timeout_s = 'soon'\n")
    daemon = subprocess.run(
        [sys.executable, "-m", "weightwire.daemon", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert daemon.returncode == 2, daemon
    assert "stall_timeout_s" in daemon.stderr, daemon.stderr
    assert "RestartPreventExitStatus=2" in path.read_text()
