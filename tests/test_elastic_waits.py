"""An engine rank's wait that spans its replica being dropped and planned again.

Two replicas of two ranks behind one daemon (host2), the trainer on host1. Replica 1's
rank 0 waits for a version a few ahead; meanwhile its partner rank leaves (replica 1 is
dropped whole, rank 0 leaves the plan) and a new process takes the partner's place
(replica 1 is planned again). The version completes at replica 1, and rank 0's wait
returns it. It used to run to its timeout ("no writes"): the wait was on the rank's
completion of the plan it left, which nothing looked at again. Real daemons in network
namespaces."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Rows, Trainer
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, NETNS_WHY, serve

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.skipif(not NETNS, reason=f"elastic tests need namespaces: {NETNS_WHY}"),
]
ROWS, COLS = 64, 32


def weights(version: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + version


@pytest.fixture(scope="module")
def three() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=3, use_netns=True, extra=FAST))


def engine(c: LocalCluster, replica: int, tp: int, job: str) -> tuple[Engine, torch.Tensor]:
    rows = ROWS // 2
    dst = torch.zeros(rows, COLS)
    e = Engine(
        replica * 2 + tp, 4, socket=c.daemons[2].socket, job=job, timeout_s=30,
        replica=replica, replica_size=2,
    )  # fmt: skip
    e.register({"w": dst}, {"w": Rows((ROWS, COLS), tp * rows, (tp + 1) * rows)})
    return e, dst


def test_a_wait_across_its_replica_dropped_and_planned_again_returns(
    three: LocalCluster,
) -> None:
    c, job = three, "elastic-wait"
    engines = {(r, tp): engine(c, r, tp, job) for r in range(2) for tp in range(2)}
    tr = Trainer(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30)
    try:
        tr.register({"w": weights(0)})
        version, deadline = 1, time.monotonic() + 30
        while len([o for o in tr.publish(version, {"w": weights(version)}).replicas if o.ok]) < 2:
            assert time.monotonic() < deadline, "the two replicas were never planned"
            version += 1
        target = version + 3
        waited: dict[str, object] = {}

        def wait() -> None:
            t0 = time.monotonic()
            try:
                waited["done"] = engines[(1, 0)][0].wait(target, timeout_s=25)
            except Exception as exc:
                waited["error"] = exc
            waited["s"] = time.monotonic() - t0

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)  # the wait is under way at the daemon
        engines[(1, 1)][0].close()  # replica 1 is dropped
        time.sleep(1.0)
        version += 1
        tr.publish(version, {"w": weights(version)})
        engines[(1, 1)] = engine(c, 1, 1, job)  # and planned again
        done_at = None
        while version < target + 20:
            version += 1
            stats = tr.publish(version, {"w": weights(version)})
            if version >= target and [o.ok for o in stats.replicas] == [True, True]:
                done_at = version
                break
            time.sleep(0.1)
        assert done_at is not None, "replica 1 never got a version again"
        waiter.join(40)
        assert "done" in waited, waited
        assert waited["done"].version == target, waited  # type: ignore[attr-defined]
        assert float(waited["s"]) < 20, waited
        for (r, tp), (eng, dst) in engines.items():
            eng.wait(done_at)
            want = weights(done_at)[tp * ROWS // 2 : (tp + 1) * ROWS // 2]
            assert torch.equal(dst, want), (r, tp)
    finally:
        tr.close()
        for eng, _ in engines.values():
            eng.close()
