"""Issue 14, items 1 and 4, with real daemons in network namespaces.

1. The trainer host's daemon is stopped (SIGSTOP) mid-version; once the engine is told the
   version failed, its weights must not change any more, not even after SIGCONT.
4. Bad and idle connections to the engine daemon's tcp data port (100 injected faults, then
   a flood of 3000): its descriptors and threads stay flat, and it serves a version bitwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import DaemonProc, LocalCluster
from weightwire.protocol.errors import WeightwireError

from .conftest import FAST, NETNS, NETNS_WHY
from .ranks.big_trainer import ROWS, weights
from .test_faults import MB, lands_then_close, pair, throttled_hosts

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
LIMITS = {"tcp-handshake-timeout-s": "2", "tcp-max-unauthenticated": "32"}


@pytest.fixture(scope="module")
def hosts() -> Iterator[LocalCluster]:
    """host0 coordinates; host1 runs the trainer rank (its link throttled); host2 the engine."""
    yield from throttled_hosts({**FAST, **MB, **LIMITS})


def test_no_byte_of_a_failed_version_lands_after_the_report(hosts: LocalCluster) -> None:
    tr, eng, dst = pair(hosts, "fence")
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    assert torch.equal(dst, weights(1))
    reported: list[tuple[BaseException, torch.Tensor]] = []

    def on_version(ev: object) -> None:
        if isinstance(ev, Exception) and not reported:
            reported.append((ev, dst.clone()))  # the engine's bytes when it is told

    eng.on_version(on_version)
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            tr.publish(2, {"w": weights(2)})
        except WeightwireError as exc:
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    trainer_daemon = hosts.daemons[1].proc
    deadline = time.time() + 20
    while not (dst == weights(2)).all(dim=1).any():  # some rows of version 2 have landed
        assert time.time() < deadline, "version 2 never began landing"
        time.sleep(0.01)
    trainer_daemon.send_signal(signal.SIGSTOP)
    try:
        deadline = time.time() + 15
        while not reported and time.time() < deadline:
            time.sleep(0.02)
        assert reported, "the engine was never told version 2 failed"
    finally:
        trainer_daemon.send_signal(signal.SIGCONT)
    exc, at_report = reported[0]
    new_rows = int((at_report == weights(2)).all(dim=1).sum())
    assert 0 < new_rows < ROWS, f"{new_rows} rows of version 2 at the report: not mid-version"
    print(f"engine told at {new_rows} of {ROWS} rows of version 2: {exc}")
    t.join(30)
    assert errors, "the trainer was never told version 2 failed"
    time.sleep(3)  # the resumed daemon has long since sent whatever it still had
    late = int((dst != at_report).any(dim=1).sum())
    assert late == 0, f"{late} rows changed after the engine was told version 2 failed ({exc})"
    lands_then_close(tr, eng, dst, 3)


# asyncio's default executor (to_thread: joining a dropped connection's threads) keeps the
# threads it grew to, at most min(32, cpus + 4): bounded, not a leak per connection
POOL = min(32, (os.cpu_count() or 1) + 4)


def usage(d: DaemonProc) -> tuple[int, int]:
    """(open descriptors, threads) of a daemon process."""
    pid = d.proc.pid
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def settle(d: DaemonProc, limit: tuple[int, int], timeout_s: float) -> tuple[int, int]:
    """The daemon's usage once it is within `limit`, or what it was at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = usage(d)
        if (now[0] <= limit[0] and now[1] <= limit[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


FAULTS = r"""
import socket, sys
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.transport.tcp.data import DataHello, Write
from weightwire.transport.tcp import wire
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hello = wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="intruder"))
for i in range(n):
    s = socket.create_connection((host, port), timeout=10)
    if i % 3 == 0:    # a write with a wrong key: refused, closed by the daemon
        s.sendall(hello + wire.encode(Write(seq=1, region=1, rkey=1, offset=0, length=8)))
        s.recv(4096)
    elif i % 3 == 1:  # dropped in the middle of a frame header
        s.sendall(hello + wire.encode(Write(seq=1, region=1, rkey=1, offset=0, length=8))[:7])
    else:             # garbage
        s.sendall(b"\xff" * 64)
    s.close()
print("faults", n, flush=True)
"""

FLOOD = r"""
import resource, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 256, n + 256))
held, refused = [], 0
start = time.monotonic()
for _ in range(n):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
        held.append(s)
    except OSError:
        refused += 1
        s.close()
print("flood", len(held), "connected", refused, "refused", round(time.monotonic() - start, 2),
      "s", flush=True)
time.sleep(4)  # idle, past the handshake timeout
for s in held:
    s.close()
"""


def run_in(c: LocalCluster, host: int, script: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    out = subprocess.run(
        [*c.prefix(host), sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_data_port_faults_and_flood_leave_fds_and_threads_flat(hosts: LocalCluster) -> None:
    tr, eng, dst = pair(hosts, "flood")
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    engine_daemon = hosts.daemons[2]
    tcp = engine_daemon.ready["transports"]["tcp"]  # type: ignore[index]
    host, port = str(tcp["host"]), str(tcp["port"])  # type: ignore[index]
    fds0, threads0 = usage(engine_daemon)
    slack = (fds0 + 6, threads0 + 4 + POOL)

    print(run_in(hosts, 1, FAULTS, host, port, "100"))
    after_faults = settle(engine_daemon, slack, 15)
    print("baseline", (fds0, threads0), "after 100 faults", after_faults)
    assert after_faults[0] <= slack[0] and after_faults[1] <= slack[1], after_faults

    peak = [0, 0]
    flooding = threading.Event()

    def sample() -> None:
        while not flooding.is_set():
            now = usage(engine_daemon)
            peak[:] = [max(peak[0], now[0]), max(peak[1], now[1])]
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        print(run_in(hosts, 1, FLOOD, host, port, "3000"))
    finally:
        flooding.set()
        sampler.join()
    after_flood = settle(engine_daemon, slack, 15)
    print("during a flood of 3000: peak", peak, "after", after_flood)
    cap = int(LIMITS["tcp-max-unauthenticated"])
    assert peak[1] <= threads0 + cap + 4 + POOL, peak  # a thread per waiting connection, capped
    assert after_flood[0] <= slack[0] and after_flood[1] <= slack[1], after_flood
    assert engine_daemon.proc.poll() is None, "the engine daemon died"

    lands_then_close(tr, eng, dst, 2)


def test_fds_and_threads_flat_across_100_dropped_data_connections(hosts: LocalCluster) -> None:
    """Each fault resets every data connection between the trainer's and the engine's
    daemons (`ss -K` on the trainer host) between two versions; the next version connects
    again. Neither daemon keeps what the dropped connections held."""
    job = "drops"
    dst = torch.zeros(256, 256)
    eng = Engine(0, 1, socket=hosts.daemons[2].socket, job=job, timeout_s=30)
    eng.register({"w": dst})
    tr = Trainer(0, 1, socket=hosts.daemons[1].socket, job=job, timeout_s=30)
    tr.register({"w": torch.zeros(256, 256)})
    tr.prepare()
    tcp = hosts.daemons[2].ready["transports"]["tcp"]  # type: ignore[index]
    host, port = str(tcp["host"]), str(tcp["port"])  # type: ignore[index]
    kill = [*hosts.prefix(1), "ss", "-K", "dst", host, "dport", "=", port]
    retried = 0

    def publish(v: int) -> None:
        nonlocal retried
        w = torch.full((256, 256), float(v))
        for attempt in range(3):  # a version may meet a connection reset under it: again
            try:
                tr.publish(v * 3 + attempt, {"w": w})
                eng.wait(v * 3 + attempt, timeout_s=30)
                assert torch.equal(dst, w)
                return
            except WeightwireError:
                retried += 1
                assert attempt < 2
        raise AssertionError("unreachable")

    publish(1)
    daemons = [hosts.daemons[1], hosts.daemons[2]]
    before = [usage(d) for d in daemons]
    killed = 0
    for v in range(2, 102):
        out = subprocess.run(kill, check=True, capture_output=True, text=True, timeout=30)
        killed += len(out.stdout.splitlines()) - 1  # ss lists what it killed
        publish(v)
    after = [
        settle(d, (b[0] + 6, b[1] + 4 + POOL), 15) for d, b in zip(daemons, before, strict=True)
    ]
    print(
        f"{killed} connections reset in 100 faults, {retried} versions retried; trainer and "
        f"engine daemons (fds, threads): before {before}, after {after}"
    )
    assert killed >= 100, killed
    for (f0, t0), (f1, t1) in zip(before, after, strict=True):
        assert f1 <= f0 + 6 and t1 <= t0 + 4 + POOL, (before, after)
    tr.close()
    eng.close()
