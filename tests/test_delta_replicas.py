"""Delta sync into engine replicas that receive the same bytes, with real daemons: each
distinct byte is compared once, whichever replica it goes to (issue 17 items 3 and 6).

Two trainer ranks hold the whole model each (data-parallel copies); two engine ranks
(two replicas of one GPU each) want the whole model. The plan of a delta-capable job
has one trainer rank send every copy of a chunk (`PlanOptions.share_keys`), so a chunk
is staged once and compared once, and its changes go to both replicas. Before, each
replica's copy of a chunk could come from a different trainer rank, which compared it
again: twice the compare for two replicas (8 times for Kimi-K2's 8).
A replica restarted between versions holds nothing verified: it gets dense, the other
keeps getting deltas; every version is checked bitwise at both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightwire.client import Engine, PublishStats, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import WeightwireError

from .conftest import FAST, NETNS
from .test_delta_e2e import SMALL, bitwise, step, weights

_jobs = itertools.count()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **SMALL})
    c.start()
    c.wait_joined()
    yield c
    assert c.stop() == [0, 0], f"daemons failed; logs in {c.workdir}"


class Replicas:
    def __init__(self, c: LocalCluster) -> None:
        self.c, self.job = c, f"replicas{next(_jobs)}"
        self.w = weights()
        self.dst: dict[int, dict[str, torch.Tensor]] = {}
        self.eng: dict[int, Engine] = {}
        for r in (0, 1):
            self.start_engine(r)
        self.tr = [
            Trainer(r, 2, socket=c.daemons[0].socket, job=self.job, timeout_s=30, delta="auto")
            for r in (0, 1)
        ]
        for tr in self.tr:
            tr.register(self.w)  # both hold every byte: either may send any chunk
        self.pool = ThreadPoolExecutor(2)
        list(self.pool.map(lambda tr: tr.prepare(), self.tr))

    def start_engine(self, rank: int) -> None:
        self.dst[rank] = {n: torch.zeros_like(t) for n, t in self.w.items()}
        eng = Engine(
            rank, 2, socket=self.c.daemons[1].socket, job=self.job, timeout_s=30, delta_area=0.25
        )
        eng.register(self.dst[rank])
        self.eng[rank] = eng

    def publish(self, v: int) -> list[PublishStats]:
        stats = list(self.pool.map(lambda tr: tr.publish(v), self.tr))
        for r, eng in self.eng.items():
            eng.wait(v)
            assert bitwise(self.dst[r], self.w), f"version {v} differs at replica {r}"
        return stats

    def close(self) -> None:
        for tr in self.tr:
            tr.close()
        for eng in self.eng.values():
            eng.close()
        self.pool.shutdown()


@pytest.fixture
def reps(cluster: LocalCluster) -> Iterator[Replicas]:
    r = Replicas(cluster)
    yield r
    r.close()


def elements(w: dict[str, torch.Tensor]) -> int:
    """What a full compare counts: units of 2 bytes (every tensor here is bf16 or fp32)."""
    return sum(t.nbytes for t in w.values()) // 2


def test_each_byte_compared_once_for_two_replicas(reps: Replicas) -> None:
    total = sum(t.nbytes for t in reps.w.values())
    staged = sum(tr.plan().shadow_bytes for tr in reps.tr)
    assert staged == total, (staged, total)  # every chunk staged by one trainer rank, once
    reps.publish(0)
    for v in range(1, 3):
        step(reps.w, 0.02, v)
        stats = reps.publish(v)
        # every element compared exactly once over both trainer ranks, not once per replica
        assert sum(s.compared for s in stats) == elements(reps.w), [s.compared for s in stats]
        assert sum(s.nbytes for s in stats) < 0.3 * total  # deltas to both replicas
        for eng in reps.eng.values():
            assert eng.delta is not None and eng.delta.held == v


def test_restarted_replica_gets_dense_the_other_delta(reps: Replicas) -> None:
    total = sum(t.nbytes for t in reps.w.values())
    reps.publish(0)
    step(reps.w, 0.02, 1)
    reps.publish(1)
    reps.eng[1].close()  # replica 1 goes away; a new one starts from zeros
    reps.start_engine(1)
    v = 2
    for _ in range(20):  # the replan reaches the trainers as PLAN_CHANGED or a failure
        step(reps.w, 0.02, v)
        try:
            stats = reps.publish(v)
            break
        except WeightwireError:
            v += 1
    else:
        raise AssertionError("never published to the new replica")
    moved = sum(s.nbytes for s in stats)
    # replica 1 dense (the whole model), replica 0 a delta: a bit more than one dense copy
    assert total <= moved < 1.3 * total, (moved, total)
    assert sum(s.delta_bytes for s in stats) > 4096
    assert sum(s.compared for s in stats) == elements(reps.w)
    step(reps.w, 0.02, v + 1)
    stats = reps.publish(v + 1)  # both hold version v now: deltas to both
    assert sum(s.nbytes for s in stats) < 0.3 * total
