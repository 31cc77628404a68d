"""A trainer rank that declared tensors never publishes on the plan it had before.

The coordinator replans after a declaration; until the new plan is installed, the
trainer's daemon still held the old one, and a version could begin on it and complete
without the new tensors (CI saw an engine tensor registered at both ends stay zeros after
its version reported complete). A declaring rank now asks for a plan other than the one
it had (`GetPlan.after_plan`); the daemon waits for it, bounded, or says why not."""

from __future__ import annotations

import time

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import GetPlan, PlanReply


def test_a_plan_other_than_the_one_named_is_awaited(cluster: LocalCluster) -> None:
    g = torch.Generator().manual_seed(3)
    w = {n: torch.randn(128, 64, generator=g).to(torch.bfloat16) for n in ("a", "b")}
    dst = {n: torch.zeros_like(t) for n, t in w.items()}
    job = "plan-after"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=20)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=20)
    try:
        eng.register({"a": dst["a"]})
        tr.register({"a": w["a"]})
        first = tr.prepare().plan_hash
        tr.publish(0)
        eng.wait(0)
        conn = tr._conn  # the rank's own session: a plan is a trainer session's
        with pytest.raises(PlanError) as err:  # nothing changes: no other plan comes
            conn.request(GetPlan(timeout_s=0.5, after_plan=first), 10)
        assert err.value.code is ErrorCode.NOT_READY
        assert first in err.value.message and "declared" in err.value.message
        got = conn.request(GetPlan(timeout_s=5, after_plan="a plan long gone"), 10)
        assert isinstance(got, PlanReply) and got.plan.plan_hash == first
        eng.register({"b": dst["b"]})
        tr.register({"b": w["b"]})
        version = 1
        for _ in range(50):  # on a plan that knows b, however late the replan
            try:
                tr.publish(version)
                break
            except PlanError as exc:  # the engine's b planned before the trainer's
                assert exc.code in (ErrorCode.PLAN, ErrorCode.PLAN_CHANGED), exc
                version += 1
                time.sleep(0.1)
        eng.wait(version)
        assert tr.plan().plan_hash != first
        assert all(torch.equal(dst[n].view(torch.uint8), w[n].view(torch.uint8)) for n in w)
    finally:
        tr.close()
        eng.close()
