"""Element types and sharing nobody chose on purpose, through real daemons, dense and as
sparse deltas, bitwise (compared as bytes: a NaN or a bool is just bits): float64, int8,
uint8, bool, int64, int16, int32, float16 and both FP8 formats side by side (element widths
1, 2, 4 and 8 in one bucket); tied source tensors (two names, one tensor) and overlapping
ones (two views of one buffer), into an engine whose two names are one tensor. Held."""

from __future__ import annotations

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster


def dtype_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "f64": torch.randn(1700, 3, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (3300,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (900,), generator=g, dtype=torch.uint8),
        "b": torch.rand(2300, generator=g) > 0.5,
        "i64": torch.randint(-(1 << 62), 1 << 62, (500,), generator=g, dtype=torch.int64),
        "i16": torch.randint(-1000, 1000, (700,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-1000, 1000, (1100,), generator=g, dtype=torch.int32),
        "f16": torch.randn(1300, generator=g).half(),
        "e4": torch.randn(1900, generator=g).to(torch.float8_e4m3fn),
        "e5": torch.randn(1900, generator=g).to(torch.float8_e5m2),
    }


def ranks(
    c: LocalCluster,
    job: str,
    delta: str,
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
) -> tuple[Trainer, Engine]:
    """A trainer rank on host0 and an engine rank on host1 (a delta area when `delta`)."""
    area = {"delta_area": 0.5} if delta != "off" else {}
    eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30, **area)
    tr = Trainer(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=30, delta=delta)
    tr.register(src)
    eng.register(dst)
    return tr, eng


@pytest.mark.parametrize("delta", ["off", "on"])
def test_every_dtype_dense_and_delta(cluster: LocalCluster, delta: str) -> None:
    src = dtype_model()
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    tr, eng = ranks(cluster, f"dtypes-{delta}", delta, src, dst)
    try:
        dense = 0
        for version in range(4):
            if version:
                for t in src.values():
                    v = t.view(-1).view(torch.uint8)
                    v[version::97] ^= 1  # a few bits each version (a bool stays 0 or 1)
            stats = tr.publish(version)
            dense = dense or stats.nbytes
            eng.wait(version, timeout_s=30)
            for n, t in src.items():
                assert torch.equal(dst[n].view(torch.uint8), t.view(torch.uint8)), (version, n)
            if delta == "on":  # verified by the engine's checksums, payloads included
                assert eng.delta is not None and eng.delta.held == version
                assert version == 0 or stats.nbytes < dense / 2, (stats.nbytes, dense)
    finally:
        tr.close()
        eng.close()


@pytest.mark.parametrize("delta", ["off", "on"])
def test_tied_and_overlapping_tensors(cluster: LocalCluster, delta: str) -> None:
    base = torch.arange(40, dtype=torch.float32)
    w = torch.randn(6, 4)
    src = {"a": w, "b": w, "o1": base[0:24].view(6, 4), "o2": base[16:40].view(6, 4)}
    tied = torch.zeros(6, 4)  # the engine's a and b are one tensor too
    dst = {"a": tied, "b": tied, "o1": torch.zeros(6, 4), "o2": torch.zeros(6, 4)}
    tr, eng = ranks(cluster, f"tied-{delta}", delta, src, dst)
    try:
        for version in range(3):
            w.add_(1)
            base[version * 7 + 17] += 100  # in both views
            tr.publish(version)
            eng.wait(version, timeout_s=30)
            for n, t in src.items():
                assert torch.equal(dst[n], t), (version, n)
            assert dst["a"] is dst["b"] and torch.equal(tied, w)
    finally:
        tr.close()
        eng.close()


def test_a_host_view_of_a_larger_buffer_warns_and_lands(cluster: LocalCluster) -> None:
    """An engine's host tensor that is part of a larger buffer moves into shared memory on
    its own (the buffer's other readers stop seeing it): registering it warns, naming the
    tensor, and the view itself still receives every version bitwise; a whole tensor
    registers without a warning."""
    w = torch.randn(6, 4)
    fused = torch.zeros(12, 4)
    dst = {"q": fused[:6], "k": torch.zeros(6, 4)}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job="hostview", timeout_s=30)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job="hostview", timeout_s=30)
    try:
        tr.register({"q": w, "k": w})
        with pytest.warns(RuntimeWarning, match=r"host tensor q is 96 bytes of a 192-byte") as rec:
            eng.register(dst)
        assert not any("host tensor k" in str(r.message) for r in rec)
        for version in range(2):
            w.add_(1)
            tr.publish(version)
            eng.wait(version, timeout_s=30)
            assert torch.equal(dst["q"], w) and torch.equal(dst["k"], w)
        assert not torch.equal(fused[:6], w)  # what the warning says
    finally:
        tr.close()
        eng.close()
