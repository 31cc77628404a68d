"""Faults with real processes: a peer daemon killed mid-transfer, daemons and the coordinator
restarted, a trainer that dies mid-publish, a rank that goes away. Transfers are made slow
(tc on the trainer host's link) so that "mid-transfer" is a real place in time."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import PeerLostError, PlanError, WeightwireError

from .conftest import FAST, NETNS, NETNS_WHY
from .ranks.big_trainer import COLS, ROWS, weights

pytestmark = pytest.mark.skipif(not NETNS, reason=f"fault tests need namespaces: {NETNS_WHY}")
HERE = Path(__file__).parent
HEARTBEAT_TIMEOUT = float(FAST["heartbeat-timeout-s"])
MB = {"max-write-bytes": str(4 << 20), "bucket-bytes": str(8 << 20)}


@pytest.fixture(scope="module")
def faults() -> Iterator[LocalCluster]:
    """host0 coordinates; host1 runs trainer ranks (its link throttled); host2 engine ranks."""
    yield from throttled_hosts({**FAST, **MB})


def throttled_hosts(extra: dict[str, str]) -> Iterator[LocalCluster]:
    """Three hosts in namespaces, host1's link throttled to 200 Mbit/s; stopped after."""
    c = LocalCluster(hosts=3, use_netns=True, extra=extra)
    c.start()
    assert c.net is not None
    c.net.throttle(1, 200)
    c.wait_joined()
    yield c
    c.stop()


def restart(c: LocalCluster, host: int) -> None:
    old = c.daemons[host]
    port = old.endpoint.rsplit(":", 1)[1] if host == 0 else "0"
    coord = "" if host == 0 else c.daemons[0].endpoint
    c.start_daemon(
        host, node=old.node, coordinator=host == 0, coordinator_endpoint=coord, peer_port=int(port)
    )
    c.wait_joined()


def pair(c: LocalCluster, job: str) -> tuple[Trainer, Engine, torch.Tensor]:
    dst = torch.zeros(ROWS, COLS)
    eng = Engine(0, 1, socket=c.daemons[2].socket, job=job, timeout_s=30)
    eng.register({"w": dst})
    tr = Trainer(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30)
    tr.register({"w": weights(0)})
    tr.prepare()
    return tr, eng, dst


def lands_then_close(tr: Trainer, eng: Engine, dst: torch.Tensor, version: int) -> None:
    """The next version lands bitwise (the cluster recovered); then both ranks close."""
    tr.publish(version, {"w": weights(version)})
    landed_then_close(tr, eng, dst, version)


def landed_then_close(tr: Trainer, eng: Engine, dst: torch.Tensor, version: int) -> None:
    """`version`, published, lands at the engine bitwise; then both ranks close."""
    eng.wait(version, timeout_s=30)
    assert torch.equal(dst, weights(version))
    tr.close()
    eng.close()


def publish_in_background(tr: Trainer, version: int, w: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["stats"] = tr.publish(version, {"w": w})
        except WeightwireError as exc:
            out["error"], out["t"] = exc, time.time()

    out["thread"] = t = threading.Thread(target=run)
    t.start()
    return out


def mid_transfer(
    c: LocalCluster, job: str
) -> tuple[Trainer, Engine, torch.Tensor, dict[str, object]]:
    """A pair whose version 1 has landed and whose version 2 is being published (in the
    background, for 0.7 s so far)."""
    tr, eng, dst = pair(c, job)
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    pending = publish_in_background(tr, 2, weights(2))
    time.sleep(0.7)
    return tr, eng, dst, pending


def test_engine_daemon_killed_mid_transfer_then_back(faults: LocalCluster) -> None:
    tr, eng, dst, pending = mid_transfer(faults, "kill-engine-daemon")
    killed = time.time()
    faults.daemons[2].proc.send_signal(signal.SIGKILL)
    pending["thread"].join(20)  # type: ignore[attr-defined]
    err = pending.get("error")
    assert isinstance(err, PeerLostError), pending
    assert "host2" in str(err), err
    assert pending["t"] - killed <= HEARTBEAT_TIMEOUT + 1.0  # type: ignore[operator]
    restart(faults, 2)  # the engine process re-registers by itself
    lands_then_close(tr, eng, dst, 3)


def test_engine_daemon_hung_mid_transfer_is_a_lost_peer(faults: LocalCluster) -> None:
    """A hung peer (SIGSTOP, not a crash: its sockets stay open) fails the version with
    PeerLostError naming it, as a dead one does, not PlanError(plan_changed) because its
    plan was withdrawn; once it runs again, the next version lands bitwise."""
    tr, eng, dst, pending = mid_transfer(faults, "hang-engine-daemon")
    stopped = time.time()
    faults.daemons[2].proc.send_signal(signal.SIGSTOP)
    try:
        pending["thread"].join(20)  # type: ignore[attr-defined]
    finally:
        time.sleep(max(0.0, stopped + HEARTBEAT_TIMEOUT + 1.0 - time.time()))
        faults.daemons[2].proc.send_signal(signal.SIGCONT)
    err = pending.get("error")
    assert isinstance(err, PeerLostError), pending
    assert "host2" in str(err), err
    assert pending["t"] - stopped <= HEARTBEAT_TIMEOUT + 1.0  # type: ignore[operator]
    deadline = time.time() + 30
    version = 3
    while True:  # the plan comes back once host2 answers heartbeats again
        try:
            tr.publish(version, {"w": weights(version)})
            break
        except (PeerLostError, PlanError) as exc:
            assert time.time() < deadline, f"no version landed after the peer came back: {exc}"
            version += 1
            time.sleep(0.2)
    landed_then_close(tr, eng, dst, version)


def test_trainer_daemon_killed_mid_transfer_then_back(faults: LocalCluster) -> None:
    tr, eng, dst = pair(faults, "kill-trainer-daemon")
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    failures: list[tuple[BaseException, float]] = []
    eng.on_version(
        lambda ev: failures.append((ev, time.time())) if isinstance(ev, Exception) else None
    )
    pending = publish_in_background(tr, 2, weights(2))
    time.sleep(0.7)
    killed = time.time()
    faults.daemons[1].proc.send_signal(signal.SIGKILL)
    deadline = time.time() + 10
    while not failures and time.time() < deadline:
        time.sleep(0.05)
    assert failures, "the engine rank was never told version 2 failed"
    exc, when = failures[0]
    assert "host1" in str(exc) and when - killed <= HEARTBEAT_TIMEOUT + 1.0, (exc, when - killed)
    with pytest.raises(WeightwireError):
        eng.wait(2, timeout_s=5)
    pending["thread"].join(20)  # type: ignore[attr-defined]
    assert isinstance(pending.get("error"), PeerLostError), pending
    restart(faults, 1)  # the trainer process re-registers by itself
    # ... once its pinger notices the restart (a publish racing that recovery is failed with
    # "publish again", which is the client's contract, not what this test is about)
    deadline = time.time() + 10
    while not any(s["role"] == "trainer" for s in fetch(faults.daemons[1].socket)["sessions"]):
        assert time.time() < deadline, "the trainer did not register again"
        time.sleep(0.05)
    lands_then_close(tr, eng, dst, 3)


def test_zero_copy_sources_registered_again_after_a_daemon_restart(faults: LocalCluster) -> None:
    """Memory from Trainer.allocate is a region of the daemon's: a restarted daemon numbers
    it anew, and the trainer's sources follow, so publishing goes on from that memory."""
    job = "zero-copy-restart"
    dst = torch.zeros(ROWS, COLS)
    eng = Engine(0, 1, socket=faults.daemons[2].socket, job=job, timeout_s=30)
    eng.register({"w": dst})
    tr = Trainer(0, 1, socket=faults.daemons[1].socket, job=job, timeout_s=30)
    w = tr.allocate({"w": ((ROWS, COLS), torch.float32)})["w"]
    w.copy_(weights(1))
    tr.register({"w": w})
    tr.publish(1)
    eng.wait(1)
    assert torch.equal(dst, weights(1))
    faults.daemons[1].proc.send_signal(signal.SIGKILL)
    faults.daemons[1].proc.wait(10)
    restart(faults, 1)
    w.copy_(weights(2))
    deadline = time.time() + 20
    while True:  # the trainer re-registers once it notices the new daemon
        try:
            tr.publish(2)
            break
        except PeerLostError:
            assert time.time() < deadline, "the trainer never re-registered"
            time.sleep(0.2)
    landed_then_close(tr, eng, dst, 2)


def test_coordinator_restarted_plan_restored(faults: LocalCluster) -> None:
    tr, eng, dst = pair(faults, "coordinator-restart")
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    before = fetch(faults.daemons[1].socket)["plans"]["coordinator-restart"]
    faults.daemons[0].proc.send_signal(signal.SIGKILL)
    faults.daemons[0].proc.wait(10)
    tr.publish(2, {"w": weights(2)})  # installed plans keep working without a coordinator
    eng.wait(2)
    restart(faults, 0)
    deadline = time.time() + 15
    jobs: dict[str, object] = {}
    while time.time() < deadline:
        jobs = (fetch(faults.daemons[0].socket).get("coordination") or {}).get("jobs", {})
        if jobs.get("coordinator-restart", {}).get("plan"):  # type: ignore[union-attr]
            break
        time.sleep(0.2)
    assert jobs["coordinator-restart"]["plan"] == before, jobs  # type: ignore[index]
    lands_then_close(tr, eng, dst, 3)


def test_trainer_dying_mid_publish_never_completes_anywhere(faults: LocalCluster) -> None:
    job = "trainer-dies"
    dst = torch.zeros(ROWS, COLS)
    eng = Engine(0, 1, socket=faults.daemons[2].socket, job=job, timeout_s=30)
    eng.register({"w": dst})
    events: list[object] = []
    eng.on_version(events.append)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    sock = faults.daemons[1].socket
    doomed = subprocess.run(
        [*faults.prefix(1), sys.executable, "-m", "tests.ranks.half_trainer", sock, job],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
        timeout=60,
    )
    assert doomed.returncode == -signal.SIGKILL, doomed.stderr
    assert "posted 1 of" in doomed.stdout
    with pytest.raises(WeightwireError) as err:
        eng.wait(1, timeout_s=15)
    assert "disconnected mid-version" in str(err.value), err.value
    assert not any(getattr(e, "version", None) == 1 for e in events), "version 1 completed"
    survivor = subprocess.Popen(
        [*faults.prefix(1), sys.executable, str(HERE / "ranks" / "big_trainer.py"), sock, job],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert survivor.stdin is not None and survivor.stdout is not None
    assert json.loads(survivor.stdout.readline())["event"] == "ready"
    survivor.stdin.write("2\n")
    survivor.stdin.flush()
    eng.wait(2, timeout_s=30)
    assert torch.equal(dst, weights(2))
    survivor.stdin.close()
    assert survivor.wait(30) == 0
    eng.close()


def test_local_socket_is_group_only_and_gone_ranks_are_released(faults: LocalCluster) -> None:
    host = faults.daemons[2]
    assert stat.S_IMODE(os.stat(host.socket).st_mode) == 0o660
    code = (
        "import sys, time, torch\n"
        "from weightwire.client import Engine\n"
        "e = Engine(0, 1, socket=sys.argv[1], job='released')\n"
        "e.register({'x': torch.zeros(1 << 20)})\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, host.socket], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    owners = [r["owner"] for r in fetch(host.socket)["regions"]]
    assert any(f"pid {p.pid}" in o for o in owners), owners
    p.kill()
    p.wait()
    deadline = time.time() + float(FAST["session-timeout-s"]) + 3
    while time.time() < deadline:
        owners = [r["owner"] for r in fetch(host.socket)["regions"]]
        if not any(f"pid {p.pid}" in o for o in owners):
            break
        time.sleep(0.2)
    assert not any(f"pid {p.pid}" in o for o in owners), "a dead rank's region was kept"


ENGINE_RANK = """
import sys, torch
from weightwire.client import Engine
from tests.ranks.big_trainer import COLS, ROWS
eng = Engine(0, 1, socket=sys.argv[1], job=sys.argv[2], timeout_s=30)
eng.register({"w": torch.zeros(ROWS, COLS)})
print("ready", flush=True)
eng.wait(1)
print("1", flush=True)
sys.stdin.read()
"""


def test_engine_rank_killed_mid_version_fails_it_and_the_next_lands(faults: LocalCluster) -> None:
    """The engine rank (a process of its own) is SIGKILLed 0.7 s into a 2 s version. The
    trainer's publish ends (failed, or done if every byte had landed in the memory the dead
    rank left) within the session timeout plus the stall timeout, never hangs; the daemons
    keep serving; the engine rank started again at once is welcome (its dead session is
    released: it was a duplicate until the session timed out) and gets the next version
    bitwise."""
    job = "engine-rank-dies"
    sock = faults.daemons[2].socket
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}

    def engine_proc() -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", ENGINE_RANK, sock, job],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE.parent,
        )  # fmt: skip
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    doomed = engine_proc()
    tr = Trainer(0, 1, socket=faults.daemons[1].socket, job=job, timeout_s=30)
    tr.register({"w": weights(0)})
    tr.prepare(timeout_s=30)
    tr.publish(1, {"w": weights(1)})
    assert doomed.stdout is not None and doomed.stdout.readline().strip() == "1"
    pending = publish_in_background(tr, 2, weights(2))
    time.sleep(0.7)
    doomed.kill()
    doomed.wait()
    killed = time.time()
    thread = pending["thread"]
    assert isinstance(thread, threading.Thread)
    bound = float(FAST["session-timeout-s"]) + float(FAST["stall-timeout-s"]) + 5
    thread.join(bound)
    assert not thread.is_alive(), f"publish of version 2 still running {bound} s after the kill"
    if "error" in pending:
        err = pending["error"]
        assert isinstance(err, WeightwireError) and err.code.value in (
            "peer_lost", "transfer", "aborted", "unknown_region", "timeout", "plan_changed"
        ), err  # fmt: skip
    for d in faults.daemons:
        assert d.proc.poll() is None and fetch(d.socket)["node"] == d.node
    dst = torch.zeros(ROWS, COLS)
    # at once: the daemon sees the dead rank's connection closed (it was refused as a
    # duplicate until the session timed out)
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=30)
    eng.register({"w": dst})
    deadline = time.time() + 30
    version = 3
    while True:  # the trainer retries retryable failures with the next version, as it should
        try:
            tr.publish(version, {"w": weights(version)})
            break
        except WeightwireError as exc:
            assert exc.code.value in ("peer_lost", "plan_changed", "not_ready", "aborted"), exc
            assert time.time() < deadline, exc
            version += 1
    eng.wait(version, timeout_s=30)
    assert torch.equal(dst, weights(version))
    print(f"publish ended {pending.get('t', killed) - killed:.2f} s after the kill", pending)
    tr.close()
    eng.close()
