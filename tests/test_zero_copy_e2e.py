"""Zero-copy sources through real daemons: tensors a trainer allocated in a registered region
are written to the engines straight from there (no staging), bitwise."""

from __future__ import annotations

import torch

from weightwire.client import Engine, Rows, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster


def test_allocated_tensors_are_written_without_staging(cluster: LocalCluster) -> None:
    job = "zero-copy"
    dst = {"w": torch.zeros(512, 256), "half": torch.zeros(64, 256)}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    eng.register(dst, {"half": Rows((128, 256), 64, 128)})
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30)
    src = tr.allocate({"w": ((512, 256), torch.float32), "half": ((128, 256), torch.float32)})
    tr.register(src)
    plan = tr.prepare()
    assert plan.staging_bytes == 0 and not any(b.packs for b in plan.buckets)
    assert all(w.src_region >= 0 for b in plan.buckets for w in b.writes)
    purposes = {r["purpose"] for r in fetch(cluster.daemons[0].socket)["regions"]}
    assert "sources" in purposes and "staging" not in purposes
    for v in (1, 2):
        src["w"].copy_(torch.randn(512, 256))
        src["half"].copy_(torch.randn(128, 256))
        tr.publish(v)
        eng.wait(v)
        assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["half"], src["half"][64:])
    tr.close()
    eng.close()
