"""The start-up timeline through the cuda transport (one GPU, trainer and engine on it, GPU
staging): the daemon stamps the version's first copy issued, its completion seen by the
lane's completion thread and handed back to the loop, in order, before the first bucket
landed, and the bytes land bitwise. Needs a GPU (scripts/gpu-suite.sh); skipped elsewhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.cudadrv import available

from .conftest import FAST, serve

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[LocalCluster]:
    yield from serve(
        LocalCluster(hosts=1, extra={**FAST, "bucket-bytes": str(1 << 20), "cuda": "on"})
    )


@pytest.mark.parametrize("slots", [0, 2])
def test_cuda_versions_report_copies_issued_seen_and_finished(
    gpu_daemon: LocalCluster, slots: int
) -> None:
    job = f"gpu-timeline-{slots}"
    gpu = torch.device("cuda", 0)
    rows, cols = 1024, 1024  # 4 MiB of float32: 4 buckets
    dst = torch.zeros(rows, cols, device=gpu)
    sock = gpu_daemon.daemons[0].socket
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=60)
    eng.register({"w": dst})
    w = torch.zeros(rows, cols, device=gpu)
    with Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=slots) as tr:
        tr.register({"w": w})
        assert len(tr.prepare().buckets) == 4
        for version in (1, 2, 3):
            w.copy_(torch.randn(rows, cols, device=gpu))
            stats = tr.publish(version)
            eng.wait(version)
            torch.cuda.synchronize(gpu)
            assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8)), version
            t = stats.timeline
            order = ["first_ready", "first_routed", "first_issued", "first_seen"]
            assert set(order) | {"first_finished", "first_landed"} == set(t), t
            stamps = [t[k] for k in order]
            assert stamps == sorted(stamps), t
            assert t["first_seen"] <= t["first_finished"] <= t["first_landed"], t
            assert 0 < stats.begin_request_seconds <= stats.begin_seconds, stats
    eng.close()
