"""Delta sync across restarts on the sending side: the trainer's daemon SIGKILLed between
delta versions and started again (the trainer process, its shadow and the engine's bytes
stay), and the trainer process itself replaced by a new one (no shadow). Real daemons in
network namespaces: host0 coordinates, host1 trains, host2 runs the engine rank. Every
version that completes is bitwise; once the trainer publishes again, deltas resume."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.posting import PublishStats
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError

from .conftest import FAST, NETNS, NETNS_WHY
from .test_delta_e2e import SMALL, Pair, _jobs, bitwise, kill_and_restart, step, weights

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")


@pytest.fixture
def three() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=3, use_netns=True, extra={**FAST, **SMALL})
    c.start()
    try:
        c.wait_joined()
        yield c
    finally:
        c.stop()


class Moved(Pair):
    """The trainer on host1, the engine on host2."""

    def __init__(self, c: LocalCluster) -> None:
        self.c, self.job = c, f"delta-restarts{next(_jobs)}"
        self.w = weights()
        self.dst = {n: torch.zeros_like(t) for n, t in self.w.items()}
        self.eng = Engine(
            0, 1, socket=c.daemons[2].socket, job=self.job, timeout_s=30, delta_area=0.25
        )
        self.eng.register(self.dst)
        self.tr = Trainer(
            0, 1, socket=c.daemons[1].socket, job=self.job, timeout_s=30, delta="auto"
        )
        self.tr.register(self.w)
        self.tr.prepare()


def publish_until(tr: Trainer, first: int, tries: int = 60) -> tuple[int, PublishStats]:
    for attempt in range(tries):
        try:
            return first + attempt, tr.publish(first + attempt)
        except WeightwireError:
            time.sleep(0.25)
    raise AssertionError("never published again")


def dense_then_delta(p: Moved) -> None:
    p.tr.publish(0)
    p.eng.wait(0)
    step(p.w, 0.02, 1)
    assert p.tr.publish(1).delta_bytes > 4096
    p.eng.wait(1)
    assert bitwise(p.dst, p.w)
    step(p.w, 0.02, 2)


def deltas_resume(p: Moved) -> None:
    """Published again (once the trainer is planned anew), bitwise; then a delta."""
    v, _ = publish_until(p.tr, 2)
    p.eng.wait(v)
    assert bitwise(p.dst, p.w)
    step(p.w, 0.02, 3)
    stats = p.tr.publish(v + 1)
    p.eng.wait(v + 1)
    assert bitwise(p.dst, p.w)
    assert stats.delta_bytes > 4096, stats


def test_trainer_daemon_restarted_between_delta_versions(three: LocalCluster) -> None:
    p = Moved(three)
    try:
        dense_then_delta(p)
        kill_and_restart(three, 1)
        deltas_resume(p)
    finally:
        p.close()


def test_trainer_process_replaced_between_delta_versions(three: LocalCluster) -> None:
    p = Moved(three)
    try:
        dense_then_delta(p)
        p.tr.close()
        p.tr = Trainer(0, 1, socket=three.daemons[1].socket, job=p.job, timeout_s=30, delta="auto")
        p.tr.register(p.w)
        deltas_resume(p)
    finally:
        p.close()


def test_trainer_back_after_its_daemon_restarted_with_a_settled_version(
    three: LocalCluster,
) -> None:
    """The trainer's daemon restarts and the trainer process too (resumed from a
    checkpoint): the new daemon knows nothing of the rank's earlier versions, and the new
    process publishes version 1 again, which the engine rank completed. The engine's
    daemon fails it at once (`aborted`, naming the version to publish, and fences the
    source), where it ignored it before (the publish waited out its whole timeout, 20 s
    here); then version 2 lands, bitwise."""
    p = Moved(three)
    try:
        dense_then_delta(p)
        p.tr.close()
        kill_and_restart(three, 1)
        p.tr = Trainer(0, 1, socket=three.daemons[1].socket, job=p.job, timeout_s=20, delta="auto")
        p.tr.register(p.w)
        t0 = time.monotonic()
        for _ in range(40):  # until the trainer is planned anew
            try:
                p.tr.publish(1)
            except WeightwireError as exc:
                if exc.code in (ErrorCode.NOT_READY, ErrorCode.PLAN_CHANGED):
                    time.sleep(0.25)
                    continue
                # the engine's verdict, or its daemon refusing the writes of a version it
                # failed, or fencing the source, whichever reaches the trainer first
                assert exc.code in (ErrorCode.ABORTED, ErrorCode.PEER_LOST), exc
                break
            raise AssertionError("a settled version completed again")
        else:
            raise AssertionError("never refused")
        assert time.monotonic() - t0 < 15  # refused at once, not a timeout
        v, stats = publish_until(p.tr, 2)
        p.eng.wait(v)
        assert bitwise(p.dst, p.w) and stats.delta_bytes < 4096  # no shadow: dense
    finally:
        p.close()
