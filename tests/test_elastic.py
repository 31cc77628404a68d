"""Elastic engines with real daemons in network namespaces: three engine replicas (two
ranks each, one daemon per replica), one killed mid-version (SIGKILL of its daemon: its
ranks' writes fail), restarted, and a fourth added, while a trainer publishes. The other
replicas' versions never fail, and every version lands bitwise where it completes."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from weightwire.client import Engine, Rows, Trainer
from weightwire.client.engine import VersionInfo
from weightwire.client.posting import PublishStats
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, NETNS_WHY

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.skipif(not NETNS, reason=f"elastic tests need namespaces: {NETNS_WHY}"),
]

ROWS, COLS = 2048, 1536  # 12 MiB of float32 per replica and version
TP = 2
HOST_OF = {0: 2, 1: 3, 2: 4, 3: 5}  # replica -> host of its daemon
MB = {"max-write-bytes": str(1 << 20), "bucket-bytes": str(2 << 20)}


def weights(version: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + version * 0.5


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """host0 coordinates, host1 runs the trainer rank (its link throttled, so that a version
    takes long enough to be killed in the middle), hosts 2-5 one engine replica each."""
    c = LocalCluster(hosts=6, use_netns=True, extra={**FAST, **MB})
    c.start()
    assert c.net is not None
    c.net.throttle(1, 400)
    c.wait_joined()
    yield c
    c.stop()


@dataclass
class Replica:
    index: int
    engines: list[Engine]
    dst: list[torch.Tensor]
    events: list[VersionInfo | Exception] = field(default_factory=list)
    registered: float = 0.0

    def check(self, version: int) -> None:
        rows = ROWS // TP
        for tp, (eng, dst) in enumerate(zip(self.engines, self.dst, strict=True)):
            eng.wait(version, timeout_s=30)
            want = weights(version)[tp * rows : (tp + 1) * rows]
            assert torch.equal(dst, want), f"replica {self.index} rank {tp} v{version}"

    def failures(self) -> list[Exception]:
        return [e for e in self.events if isinstance(e, Exception)]

    def close(self) -> None:
        for e in self.engines:
            e.close()


def replica(c: LocalCluster, index: int, job: str) -> Replica:
    rows = ROWS // TP
    sock = c.daemons[HOST_OF[index]].socket
    r = Replica(index, [], [])
    for tp in range(TP):
        dst = torch.zeros(rows, COLS)
        eng = Engine(
            index * TP + tp, 8, socket=sock, job=job, timeout_s=30, replica=index, replica_size=TP
        )
        eng.on_version(r.events.append)
        eng.register({"w": dst}, {"w": Rows((ROWS, COLS), tp * rows, (tp + 1) * rows)})
        r.engines.append(eng)
        r.dst.append(dst)
    r.registered = time.monotonic()
    return r


def restart(c: LocalCluster, host: int) -> None:
    old = c.daemons[host]
    c.start_daemon(host, node=old.node, coordinator_endpoint=c.daemons[0].endpoint)
    c.wait_joined()


def plan_of(c: LocalCluster, host: int, job: str) -> str:
    return str(fetch(c.daemons[host].socket)["plans"].get(job))


def publish_in_background(tr: Trainer, version: int) -> dict[str, object]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["stats"] = tr.publish(version, {"w": weights(version)})
        except Exception as exc:
            out["error"] = exc

    out["thread"] = t = threading.Thread(target=run)
    t.start()
    return out


def outcomes(stats: PublishStats) -> dict[int, bool]:
    return {o.replica: o.ok for o in stats.replicas}


def test_replica_killed_restarted_and_added(cluster: LocalCluster) -> None:
    job = "elastic"
    reps = [replica(cluster, i, job) for i in range(3)]
    tr = Trainer(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=60)
    tr.register({"w": weights(0)})
    tr.prepare()
    deadline = time.monotonic() + 30
    version = 1
    stats = tr.publish(version, {"w": weights(version)})
    while set(outcomes(stats)) != {0, 1, 2}:  # planned before every replica had registered
        assert time.monotonic() < deadline, outcomes(stats)
        time.sleep(0.2)
        version += 1
        stats = tr.publish(version, {"w": weights(version)})
    assert all(outcomes(stats).values()), stats.replicas
    for r in reps:
        r.check(version)
    survivors = [reps[0], reps[2]]
    plans_before = {i: plan_of(cluster, HOST_OF[i], job) for i in (0, 2)}

    # replica 1's daemon dies in the middle of a version: the others complete it bitwise
    version += 1
    pending = publish_in_background(tr, version)
    time.sleep(0.25)
    cluster.daemons[HOST_OF[1]].proc.send_signal(signal.SIGKILL)
    pending["thread"].join(60)  # type: ignore[attr-defined]
    assert "error" not in pending, pending.get("error")
    stats = pending["stats"]  # type: ignore[assignment]
    got = outcomes(stats)
    assert got[0] and got[2] and not got[1], stats.replicas
    failed = next(o for o in stats.replicas if o.replica == 1)
    assert failed.code == "peer_lost" and "host3" in failed.message, failed
    for r in survivors:
        r.check(version)
    cluster.daemons[HOST_OF[1]].proc.wait(10)

    # the next versions go to the live replicas only, with the same engine plans there
    version += 1
    stats = tr.publish(version, {"w": weights(version)})
    for r in survivors:
        r.check(version)
    assert {i: plan_of(cluster, HOST_OF[i], job) for i in (0, 2)} == plans_before

    # replica 1 restarted (its ranks register again by themselves): it catches up bitwise
    restart(cluster, HOST_OF[1])
    back = time.monotonic()
    deadline = back + 30
    while not outcomes(stats).get(1):
        assert time.monotonic() < deadline, "the restarted replica never got a version"
        version += 1
        stats = tr.publish(version, {"w": weights(version)})
    restarted_s = time.monotonic() - back
    for r in reps:
        r.check(version)
    # the trainer holds the plan with the restarted replica's regions (new ids, the same
    # plan hash): a rank packing in place writes to its plan's regions
    held = tr._start.plan(5)
    tr._start.forget_plan()
    assert tr._start.plan(5).regions == held.regions, "the trainer's plan is stale"
    assert {i: plan_of(cluster, HOST_OF[i], job) for i in (0, 2)} == plans_before

    # a fourth replica joins while the trainer publishes back to back
    stop = threading.Event()
    published: list[PublishStats] = []
    errors: list[Exception] = []

    def loop(first: int) -> None:
        v = first
        while not stop.is_set():
            try:
                published.append(tr.publish(v, {"w": weights(v)}))
            except Exception as exc:
                errors.append(exc)
                return
            v += 1

    t = threading.Thread(target=loop, args=(version + 1,))
    t.start()
    try:
        time.sleep(0.3)
        reps.append(replica(cluster, 3, job))
        fourth = reps[3]
        deadline = time.monotonic() + 30
        while not [e for e in fourth.events if isinstance(e, VersionInfo)]:
            assert time.monotonic() < deadline, "the fourth replica never got a version"
            assert not fourth.failures(), fourth.failures()
            time.sleep(0.01)
        joined_s = time.monotonic() - fourth.registered
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    first = next(e for e in fourth.events if isinstance(e, VersionInfo)).version
    fourth.check(first)
    last = published[-1]
    assert all(outcomes(last).values()) and set(outcomes(last)) == {0, 1, 2, 3}, last.replicas
    for r in reps:
        r.check(last.version)
    assert {i: plan_of(cluster, HOST_OF[i], job) for i in (0, 2)} == plans_before
    for r in survivors:
        assert not r.failures(), r.failures()
    planned = [
        e for e in cluster.daemons[0].logs()
        if e.get("event") == "engine replica planned" and e.get("job") == job
    ]  # fmt: skip
    counts = {i: sum(e["replica"] == i for e in planned) for i in range(4)}
    assert counts == {0: 1, 1: 2, 2: 1, 3: 1}, counts  # nobody else's routes were remade
    print(
        json.dumps(
            {
                "restart_to_first_version_s": round(restarted_s, 3),
                "registration_to_first_version_s": round(joined_s, 3),
                "version_seconds": round(last.seconds, 3),
                "replica_plan_seconds": [e["seconds"] for e in planned],
            }
        )
    )
    tr.close()
    for r in reps:
        r.close()


def test_one_rank_of_a_replica_leaves_mid_version(cluster: LocalCluster) -> None:
    """One engine rank of replica 1 goes away mid-version (its session ends, its memory is
    deregistered): replica 1 is dropped whole, replicas 0 and 2 complete bitwise, now and
    in the next version, without a failure."""
    job = "elastic-rank"
    reps = [replica(cluster, i, job) for i in range(3)]
    tr = Trainer(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=60)
    tr.register({"w": weights(0)})
    tr.prepare()
    version, deadline = 1, time.monotonic() + 30
    stats = tr.publish(version, {"w": weights(version)})
    while set(outcomes(stats)) != {0, 1, 2}:
        assert time.monotonic() < deadline, outcomes(stats)
        version += 1
        stats = tr.publish(version, {"w": weights(version)})
    version += 1
    pending = publish_in_background(tr, version)
    time.sleep(0.25)
    reps[1].engines[1].close()
    pending["thread"].join(60)  # type: ignore[attr-defined]
    assert "error" not in pending, pending.get("error")
    got = outcomes(pending["stats"])  # type: ignore[arg-type]
    assert got[0] and got[2], got
    for r in (reps[0], reps[2]):
        r.check(version)
    version += 1
    stats = tr.publish(version, {"w": weights(version)})
    assert outcomes(stats) in ({0: True, 2: True}, {0: True, 1: False, 2: True}), stats.replicas
    for r in (reps[0], reps[2]):
        r.check(version)
        assert not r.failures(), r.failures()
    tr.close()
    reps[1].engines[0].close()
    for r in (reps[0], reps[2]):
        r.close()
