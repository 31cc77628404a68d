"""An engine rank leaves: the job's plan is withdrawn at every node, and publishes wait for
the next plan.

The coordinator withdrew an incomplete job's plan without telling the nodes: the trainer's
daemon kept it, and every publish wrote on into the regions of the engine rank that had
left, failing `unknown_region` (not retryable) until the rank came back. Now the nodes are
told: a trainer rank's publish waits for the next plan, as for its first, and at its
timeout fails `not_ready` (retryable), naming the plan withdrawn and the engine ranks that
the job lacks; status shows the plan withdrawn; the rank back, the next publish lands
bitwise. Real daemons in network namespaces: host0 coordinates, host1 trains, host2 runs
the engine ranks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.cli.status import render
from weightwire.client import Engine, Rows, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, PlanError, retryable

from .conftest import FAST, NETNS, NETNS_WHY, serve
from .test_faults import publish_in_background

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
SHAPE = (64, 256)
WAIT_S = 3.0  # the trainer's timeout while the engine rank is away


@pytest.fixture(scope="module")
def three() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=3, use_netns=True, extra=FAST))


def engine(c: LocalCluster, job: str, rank: int, dst: torch.Tensor, **replica: int) -> Engine:
    e = Engine(rank, 2, socket=c.daemons[2].socket, job=job, timeout_s=30, **replica)
    e.register({"w": dst}, sources={"w": Rows(SHAPE, 32 * rank, 32 * rank + 32)})
    return e


def landed(dsts: list[torch.Tensor], src: torch.Tensor) -> bool:
    return all(torch.equal(d, src[32 * r : 32 * r + 32]) for r, d in enumerate(dsts))


def withdrawn_at(c: LocalCluster, host: int, job: str, lacks: str) -> str:
    """The withdrawal of `job`'s plan as host's daemon status shows it, once it has reached
    that daemon (a publish begun before that began on the old plan)."""
    deadline = time.monotonic() + 10
    while (why := fetch(c.daemons[host].socket).get("plans_withdrawn", {}).get(job)) is None:
        assert time.monotonic() < deadline, f"host{host} was never told the plan is withdrawn"
        time.sleep(0.02)
    status = fetch(c.daemons[host].socket)
    assert lacks in why and job not in status["plans"], why
    assert f"plan of job {job!r} WITHDRAWN: {why}" in render(status)  # `weightwire status`
    return str(why)


def waits_in_vain(tr: Trainer, version: int, lacks: str) -> None:
    """A publish waits for a plan, and fails `not_ready` at its timeout, retryable, naming
    the plan withdrawn and the ranks the job `lacks`."""
    with pytest.raises(PlanError) as caught:
        tr.publish(version, {"w": torch.randn(SHAPE)})
    err = caught.value
    assert err.code is ErrorCode.NOT_READY and retryable(err), err
    assert "withdrawn" in err.message and lacks in err.message, err


def rank_leaves_and_comes_back(c: LocalCluster, job: str, lacks: str, **replica: int) -> None:
    """Engine rank 1 of 2 leaves after version 1: its nodes are told; a publish waits and
    fails `not_ready`,
    retryable, naming `lacks`; status shows the plan withdrawn; the next version waits for
    the rank to come back and lands bitwise."""
    dsts = [torch.zeros(32, SHAPE[1]), torch.zeros(32, SHAPE[1])]
    with Trainer(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30) as tr:
        tr.register({"w": torch.zeros(SHAPE)})
        e0, e1 = (engine(c, job, r, dsts[r], **replica) for r in (0, 1))
        with e0:
            plan = tr.prepare().plan_hash
            src = torch.randn(SHAPE)
            tr.publish(1, {"w": src})
            e0.wait(1)
            e1.wait(1)
            assert landed(dsts, src)
            e1.close()
            withdrawn_at(c, 1, job, lacks)
            withdrawn_at(c, 2, job, lacks)  # rank 0 is still there
            tr.timeout_s = WAIT_S
            waits_in_vain(tr, 2, lacks)
            coordinated = fetch(c.daemons[0].socket)["coordination"]["jobs"][job]
            assert coordinated["plan"] is None and coordinated["withdrawn"], coordinated
            assert coordinated["missing"] == [lacks], coordinated
            if not replica:  # an elastic trainer plan's hash is its packs', not the job's
                assert coordinated["withdrawn"] == plan, coordinated

            # the rank comes back while version 3 waits for a plan: it lands, bitwise
            tr.timeout_s = 30
            src = torch.randn(SHAPE)
            pending = publish_in_background(tr, 3, src)
            dsts[1] = torch.zeros(32, SHAPE[1])
            with engine(c, job, 1, dsts[1], **replica) as back:
                thread = pending["thread"]
                assert isinstance(thread, threading.Thread)
                thread.join(60)
                assert not thread.is_alive() and "error" not in pending, pending
                e0.wait(3)
                back.wait(3)
                assert landed(dsts, src)
                assert job not in fetch(c.daemons[1].socket)["plans_withdrawn"]


def test_engine_rank_leaves_publishes_wait_for_the_plan(three: LocalCluster) -> None:
    rank_leaves_and_comes_back(three, "withdrawn", "engine ranks [1]")


def test_elastic_replica_incomplete_publishes_wait_for_the_plan(three: LocalCluster) -> None:
    """The job's only engine replica loses a rank: no complete replica is left."""
    rank_leaves_and_comes_back(
        three, "withdrawn-elastic", "engine ranks [1] of replica 0", replica=0, replica_size=2
    )


def test_every_engine_rank_leaves_names_them(three: LocalCluster) -> None:
    """Both engine ranks leave: the job had a plan, so the ranks it lacks are named (the
    engine world size it was planned with), not "any engine rank"."""
    job = "withdrawn-all"
    dsts = [torch.zeros(32, SHAPE[1]), torch.zeros(32, SHAPE[1])]
    with Trainer(0, 1, socket=three.daemons[1].socket, job=job, timeout_s=30) as tr:
        tr.register({"w": torch.zeros(SHAPE)})
        with engine(three, job, 0, dsts[0]), engine(three, job, 1, dsts[1]) as e1:
            src = torch.randn(SHAPE)
            tr.publish(1, {"w": src})
            e1.wait(1)
        withdrawn_at(three, 1, job, "engine ranks [0, 1]")
        tr.timeout_s = WAIT_S
        waits_in_vain(tr, 2, "engine ranks [0, 1]")
