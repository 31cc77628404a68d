"""`tests/test_delta_layouts.py`'s layouts on a GPU: trainer tensors and engine tensors on
GPU 0 behind one daemon (the `cuda` transport, GPU staging), so the sender's torch path
(compare, encode, shadow scatter), the engine's GPU apply and checksum, and FP8
quantization on the GPU are what run. Dense first, then deltas, every version bitwise
against the plain reference (built on the CPU: FP8 block quantization is bitwise the same
on every device).

    python -m pytest -m gpu tests/test_delta_layouts_gpu.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST
from .test_delta_e2e import SMALL
from .test_delta_gpu import pytestmark
from .test_delta_layouts import LAYOUTS, Job, run

__all__ = ["pytestmark"]  # gpu, and skipped where there is none (as test_delta_gpu)


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[LocalCluster]:
    # a version's first packs compile the GPU kernels (Triton, FP8), seconds on a cold cache
    c = LocalCluster(hosts=1, extra={**FAST, **SMALL, "version-timeout-s": "60"})
    c.keys("host0")
    c.start_daemon(0, coordinator=True, flags={"cuda": "on"})
    c.wait_joined()
    yield c
    assert c.stop() == [0], f"daemon failed; logs in {c.workdir}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f.__name__ for f in LAYOUTS])
def test_layout_on_gpu(
    gpu_cluster: LocalCluster, layout: Callable[[torch.device], tuple[Job, float]]
) -> None:
    job, density = layout(torch.device("cuda", 0))
    run(gpu_cluster, job, density=density)
