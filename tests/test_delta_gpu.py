"""Delta sync on a GPU: the codec and checksum on CUDA tensors (bitwise against the CPU),
their rates in GB/s of dense input, and an end-to-end sync colocated on one GPU (trainer
staging and engine tensors on the same device, the `cuda` transport), dense then delta
versions in the same run, bitwise against the trainer's weights. Figures are printed
(run with -s), never asserted.

    python -m pytest -m gpu -s tests/test_delta_gpu.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.delta import apply_kernel, codec, digest, digest_kernel
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.cudadrv import available

from .conftest import FAST

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]


def _sync() -> None:
    torch.cuda.synchronize()


def _pair(
    nbytes: int, density: float, dev: torch.device, width: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights (width 2) or FP8 codes (width 1), `density` of the elements changed."""
    g = torch.Generator(device=dev).manual_seed(0)
    n = nbytes // width
    if width == 2:
        old = (torch.randn(n, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        new = old.clone()
        mask = torch.rand(n, device=dev, generator=g) < density
        new[mask] = (new[mask].float() + 1e-3).to(torch.bfloat16)
        return new.view(torch.uint8), old.view(torch.uint8)
    old = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
    new = old.clone()
    mask = torch.rand(n, device=dev, generator=g) < density
    new[mask] ^= 1  # the code's lowest bit: another FP8 value
    return new, old


@pytest.mark.parametrize(("density", "width"), [(0.01, 2), (0.03, 2), (0.1, 2), (0.01, 1)])
def test_codec_on_gpu_rates(density: float, width: int) -> None:
    dev = torch.device("cuda", 0)
    nbytes = 1 << 30
    new, old = _pair(nbytes, density, dev, width)
    warm = codec.encode(new[: 1 << 20], old[: 1 << 20], width)  # warm up encode and apply
    codec.apply(old[: 1 << 20].clone(), warm.kind, warm.body, warm.count, width)
    _sync()
    t0 = time.perf_counter()
    enc = codec.encode(new, old, width)
    _sync()
    encode_s = time.perf_counter() - t0
    codec.apply(old.clone(), enc.kind, enc.body, enc.count, width)  # this body's kernel
    out = old.clone()
    _sync()
    t0 = time.perf_counter()
    codec.apply(out, enc.kind, enc.body, enc.count, width)
    _sync()
    apply_s = time.perf_counter() - t0
    assert torch.equal(out, new)
    # the same body decodes on the CPU to the same bytes
    cpu = old[: 1 << 24].cpu()
    part = codec.encode(new[: 1 << 24], old[: 1 << 24], width, mode="on")
    codec.apply(cpu, part.kind, part.body.cpu(), part.count, width)
    assert torch.equal(cpu, new[: 1 << 24].cpu())
    digest.tdigest([out[: 1 << 20]])  # warm up (the first call compiles the kernel)
    _sync()
    t0 = time.perf_counter()
    h = digest.tdigest([out])
    _sync()
    digest_s = time.perf_counter() - t0
    assert h == digest.tdigest([out.cpu()])  # one function on the GPU and the CPU
    print(
        json.dumps(
            {
                "test": "delta codec on GPU",
                "device": torch.cuda.get_device_name(dev),
                "dense_bytes": nbytes,
                "density": density,
                "width": width,
                "kind": enc.kind.name,
                "wire_ratio": round(enc.body.numel() / nbytes, 5),
                "encode_gbps": round(nbytes / encode_s / 1e9, 1),
                "apply_gbps": round(nbytes / apply_s / 1e9, 1),
                "checksum_gbps": round(nbytes / digest_s / 1e9, 1),
            }
        )
    )


@pytest.mark.parametrize("width", [1, 2, 4])
def test_block16_apply_kernel_same_as_torch(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`apply_kernel.block16` writes what torch's decode + index_copy_ writes: a ragged last
    block, empty blocks, a full block; garbled bodies (counts off, a position repeated, one
    past the end) raise ValueError on both paths, and a body whose counts are off writes
    nothing."""
    probe = torch.zeros(8, dtype=torch.uint8, device="cuda")
    if not apply_kernel.available(probe, probe, width):
        pytest.skip("no Triton here")
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(2)
    n = 5 * codec.BLOCK + 777  # elements
    old = torch.randint(0, 256, (n * width,), dtype=torch.uint8, device=dev, generator=g)
    for density in (0.0, 0.001, 0.03, 0.5):
        new = old.clone()
        mask = torch.rand(n, device=dev, generator=g) < density
        mask[3 * codec.BLOCK : 4 * codec.BLOCK] = True  # a full block
        mask[codec.BLOCK : 2 * codec.BLOCK] = False  # an empty one
        mask[-1] = True  # the ragged block's last element
        new.view(-1, width)[mask] ^= 0x5A
        changed = codec.changes(new, old, width)
        body = codec.encode_positions(new, changed, width, codec.Kind.BLOCK16)
        k = int(changed.numel())
        fast, slow = old.clone(), old.clone()
        codec.apply(fast, codec.Kind.BLOCK16, body, k, width)
        with monkeypatch.context() as m:
            m.setattr(apply_kernel, "ENABLED", False)
            codec.apply(slow, codec.Kind.BLOCK16, body, k, width)
        assert torch.equal(fast, new) and torch.equal(slow, new), density
    nb = -(-n // codec.BLOCK)
    pos = torch.tensor([5, 9, codec.BLOCK + 1], device=dev)
    vals = torch.full((3 * width,), 7, dtype=torch.uint8, device=dev)
    good = codec.encode_body(pos, vals, n, width, codec.Kind.BLOCK16)
    off = good.clone()
    off[:4].view(torch.int32)[0] += 1  # counts add up to 4, not 3
    repeated = good.clone()
    repeated[4 * nb + 2 : 4 * nb + 4].view(torch.int16)[0] = 5  # 5, 5: not increasing
    past = codec.encode_body(torch.tensor([n - 1], device=dev), vals[:width], n, width,
                             codec.Kind.BLOCK16)  # fmt: skip
    past[4 * nb : 4 * nb + 2].view(torch.int16)[0] = (n % codec.BLOCK) & 0xFFFF  # n itself
    for body, k in ((off, 3), (repeated, 3), (past, 1)):
        for on in (True, False):
            target = old.clone()
            with monkeypatch.context() as m:
                m.setattr(apply_kernel, "ENABLED", on)
                with pytest.raises(ValueError):
                    codec.apply(target, codec.Kind.BLOCK16, body, k, width)
            if body is off:
                assert torch.equal(target, old), "counts off: nothing written"
    t = old.clone()
    codec.apply(t, codec.Kind.BLOCK16, good, 3, width)
    assert torch.equal(t.view(-1, width)[pos], vals.view(3, width))


def test_checksum_kernel_same_as_torch_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton weighted sums (`digest_kernel`) give `tdigest` bit for bit what torch's
    product-and-sum gives on the GPU and numpy on the CPU: empty, ragged tails, a table
    and a half, across the 256 MiB chunking of a block, misaligned blocks; then the rates
    on 2 GiB, kernel against torch in the same run (printed)."""
    if not digest_kernel.available(torch.zeros(1, dtype=torch.int64, device="cuda")):
        pytest.skip("no Triton here")
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)
    big = torch.randint(0, 256, ((1 << 28) + 4096,), dtype=torch.uint8, device=dev, generator=g)
    sizes = [0, 1, 7, 8, 9, 8 * digest.TABLE, 12 * digest.TABLE + 13, (1 << 28) + 4093]
    blocks = [big[:n] for n in sizes] + [big[3 : 3 + 8 * 5000 + 5]]  # the last misaligned
    for block in blocks:
        fast = digest.tdigest([block])
        with monkeypatch.context() as m:
            m.setattr(digest_kernel, "ENABLED", False)
            slow = digest.tdigest([block])
        assert fast == slow, block.numel()
        if block.numel() < (1 << 26):
            assert fast == digest.tdigest([block.cpu()]), block.numel()
    flipped = big[: 1 << 20].clone()
    flipped[12345] ^= 1
    assert digest.tdigest([flipped]) != digest.tdigest([big[: 1 << 20]])
    data = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device=dev, generator=g)
    rates = {}
    for name, on in (("kernel", True), ("torch", False)):
        with monkeypatch.context() as m:
            m.setattr(digest_kernel, "ENABLED", on)
            digest.tdigest([data[: 1 << 24]])
            _sync()
            t0 = time.perf_counter()
            digest.tdigest([data])
            _sync()
            rates[name] = round(data.numel() / (time.perf_counter() - t0) / 1e9, 1)
    t0 = time.perf_counter()
    data.clone()
    _sync()
    copy_gbps = round(data.numel() / (time.perf_counter() - t0) / 1e9, 1)
    print(json.dumps({"test": "checksum kernel", "checksum_gbps": rates,
                      "copy_gbps_same_bytes": copy_gbps}))  # fmt: skip


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=1, extra=FAST)
    c.keys("host0")
    c.start_daemon(0, coordinator=True, flags={"cuda": "on"})
    c.wait_joined()
    yield c
    assert c.stop() == [0], f"daemon failed; logs in {c.workdir}"


def test_delta_end_to_end_colocated(gpu_cluster: LocalCluster) -> None:
    """Trainer and engine on GPU 0: dense, then delta versions; both kinds timed per step."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)
    w = {
        f"layers.{i}.weight": (torch.randn(8192, 8192, device=dev, generator=g) * 0.02).to(
            torch.bfloat16
        )
        for i in range(8)
    }  # 1.07 GB
    dst = {n: torch.zeros_like(t) for n, t in w.items()}
    eng = Engine(0, 1, socket=gpu_cluster.daemons[0].socket, job="dgpu", delta_area=0.25)
    eng.register(dst)
    tr = Trainer(0, 1, socket=gpu_cluster.daemons[0].socket, job="dgpu", delta="auto")
    tr.register(w)
    tr.prepare()
    tr.publish(0)
    eng.wait(0)
    assert all(torch.equal(dst[n].view(torch.uint8), w[n].view(torch.uint8)) for n in w)
    rows, version = [], 0
    for step in range(3):
        for t in w.values():
            mask = torch.rand(t.shape, device=dev, generator=g) < 0.02
            t[mask] = (t[mask].float() * 1.01 + 1e-4).to(torch.bfloat16)
        version += 1
        tr.delta.mode = "auto"
        delta = tr.publish(version)
        eng.wait(version)
        assert all(torch.equal(dst[n].view(torch.uint8), w[n].view(torch.uint8)) for n in w)
        rx = eng.delta
        assert rx is not None  # the engine's checks: as buckets landed, and at the end
        early = {
            "early_ranges": rx.early_ranges,
            "tail_ranges": rx.tail_ranges,
            "engine_early_s": round(rx.early_s, 4),
            "engine_tail_s": round(rx.tail_s, 4),
        }
        version += 1
        tr.delta.mode = "off"
        dense = tr.publish(version)
        eng.wait(version)
        assert all(torch.equal(dst[n].view(torch.uint8), w[n].view(torch.uint8)) for n in w)
        rows.append(
            {
                "step": step,
                "density": round(delta.density, 5),
                "delta_bytes": delta.nbytes,
                "dense_bytes": dense.nbytes,
                "delta_s": round(delta.total_seconds, 4),
                "dense_s": round(dense.total_seconds, 4),
                "speedup": round(dense.total_seconds / delta.total_seconds, 3),
                **early,
            }
        )
    tr.close()
    eng.close()
    print(json.dumps({"test": "delta end to end, colocated", "steps": rows}))
