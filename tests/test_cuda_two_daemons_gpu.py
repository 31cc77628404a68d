"""Two daemons on one GPU host, both with the cuda transport: two trainer ranks (host
tensors) on one write into an engine rank's GPU memory on the other, by CUDA IPC, the
immediates of the landed copies crossing the daemons' channel (transport/cuda/channel.py).
Several jobs, dense and delta versions, each checked bitwise.

The channel sent one immediate per datagram on a non-blocking socket, and the engine
daemon's queue holds 10 (`net.unix.max_dgram_qlen`): a batch of copies landing at once
lost the immediates past that, silently, and the version timed out with every byte there
(H100: 13 of 16 writes, 3 of 6 runs; also before this session's changes). See
tests/test_cuda_channel.py for the channel alone."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"),
]
EXTRA = {**FAST, "version-timeout-s": "20", "bucket-bytes": str(1 << 20)}
_jobs = itertools.count()


def tensors(v: int) -> dict[str, torch.Tensor]:
    """16 bf16 tensors of different sizes, new values each version."""
    out = {}
    for i in range(16):
        t = torch.arange((16 + 4 * i) * 64, dtype=torch.float32) * 0.001 + i + v
        out[f"t{i}"] = t.reshape(-1, 64).to(torch.bfloat16)
    return out


def publish_both(trs: list[Trainer], version: int) -> dict[int, BaseException]:
    """Both ranks publish `version` at once; their errors by rank."""
    errors: dict[int, BaseException] = {}

    def one(rank: int) -> None:
        try:
            trs[rank].publish(version)
        except BaseException as exc:  # reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(trs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("delta", ["off", "on"])
def test_two_trainer_ranks_into_gpu_memory_of_another_daemon(delta: str) -> None:
    c = LocalCluster(hosts=2, use_netns=False, extra=EXTRA)
    c.start()
    try:
        c.wait_joined()
        for _ in range(3):
            job = f"two-daemons{next(_jobs)}"
            w = tensors(0)
            names = sorted(w)
            dst = {n: torch.zeros_like(t, device="cuda") for n, t in w.items()}
            area = {"delta_area": 1.0} if delta == "on" else {}
            eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30, **area)
            trs = [
                Trainer(r, 2, socket=c.daemons[0].socket, job=job, timeout_s=30, delta=delta)
                for r in range(2)
            ]
            try:
                eng.register(dst)
                for r, tr in enumerate(trs):
                    tr.register({n: w[n] for n in names[r::2]})
                for v in range(4):
                    for n, t in tensors(v).items():
                        w[n].copy_(t)
                    assert not publish_both(trs, v), f"{job} version {v}"
                    eng.wait(v, timeout_s=30)
                    for n in names:
                        assert torch.equal(
                            dst[n].cpu().view(torch.int16), w[n].view(torch.int16)
                        ), n
            finally:
                for tr in trs:
                    tr.close()
                eng.close()
    finally:
        assert c.stop() == [0, 0]
