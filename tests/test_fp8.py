"""FP8 block quantization and the FP8 pack ops, bitwise against a plain per-tile loop."""

from __future__ import annotations

import math

import pytest
import torch

from weightwire.client import pack as packmod
from weightwire.client.fp8 import dequantize_blocks, quantize_blocks
from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy, Fp8BlockQuant, Fp8BlockScale


def reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile at a time, written from the convention's definition and nothing else."""
    lead = x.shape[:-2]
    rows, cols = x.shape[-2], x.shape[-1]
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((*lead, nr, nc), dtype=torch.float32)
    for idx in range(math.prod(lead)):
        at: list[int] = []
        rest = idx
        for n in reversed(lead):
            at.insert(0, rest % n)
            rest //= n
        for i in range(nr):
            for j in range(nc):
                r0, r1 = i * block, min((i + 1) * block, rows)
                c0, c1 = j * block, min((j + 1) * block, cols)
                tile = x[(*at, slice(r0, r1), slice(c0, c1))].to(torch.float32)
                amax = torch.max(torch.abs(tile))
                amax = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32))
                scale = amax / 448.0
                q = torch.clamp(tile / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
                codes[(*at, slice(r0, r1), slice(c0, c1))] = q
                scales[(*at, i, j)] = scale
    return codes, scales


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    ints = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    # a wide dynamic range, so tiles get very different scales and some codes saturate
    x = x * torch.exp(torch.randn(shape, generator=g) * 3)
    return x.to(dtype)


SHAPES = [
    (128, 128),
    (256, 384),
    (1, 1),
    (5, 7),
    (130, 257),
    (127, 129),
    (300, 100),
    (3, 200, 130),
    (2, 128, 256),
    (2, 3, 70, 140),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = sample(shape, dtype, seed=sum(shape))
    codes, scales = quantize_blocks(x)
    want_codes, want_scales = reference(x, 128)
    bits_equal(codes, want_codes)
    bits_equal(scales, want_scales)


@pytest.mark.parametrize("block", [1, 16, 32, 64, 100])
def test_other_block_sizes(block: int) -> None:
    x = sample((2, 150, 90), torch.bfloat16, seed=block)
    codes, scales = quantize_blocks(x, block)
    want_codes, want_scales = reference(x, block)
    bits_equal(codes, want_codes)
    bits_equal(scales, want_scales)


def test_zero_and_tiny_tiles_use_the_floor() -> None:
    x = torch.zeros(3, 260, 300, dtype=torch.bfloat16)
    x[1, 130:140, 5:9] = 1e-6  # a tile whose amax is below the 1e-4 floor
    x[2, :128, :128] = torch.linspace(-2, 2, 128 * 128).reshape(128, 128)
    x[2, 200, 299] = -3000.0  # a lone large value in the last, partial tile
    codes, scales = quantize_blocks(x)
    want_codes, want_scales = reference(x, 128)
    bits_equal(codes, want_codes)
    bits_equal(scales, want_scales)
    assert (scales[0] == torch.tensor(1e-4, dtype=torch.float32) / 448.0).all()
    assert (codes[0].float() == 0).all()


def test_saturation_and_shapes() -> None:
    x = sample((4, 256, 384), torch.bfloat16, seed=3)
    codes, scales = quantize_blocks(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (4, 2, 3)
    assert codes.float().abs().max().item() == 448.0  # each tile's amax maps to 448
    assert codes.is_contiguous() and scales.is_contiguous()


def test_quotients_above_448_saturate_like_the_clamp() -> None:
    """Where float32(amax) / float32(amax / 448) rounds above 448, the literal formula's
    clamp bites; the one-pass store must give the same code (448)."""
    g = torch.Generator().manual_seed(11)
    amax = torch.rand(64 * 64, generator=g, dtype=torch.float32) * 100 + 1e-3
    scale = amax / torch.full_like(amax, 448.0)
    over = (amax / scale) > 448.0
    assert over.any()  # the case exists (about a quarter of random amaxes)
    tiles = torch.randn(64, 128, 64, 128, generator=g) * 0.1
    tiles[:, 0, :, 0] = amax.reshape(64, 64) * torch.where(
        torch.rand(64, 64, generator=g) < 0.5, -1, 1
    )
    x = tiles.reshape(64 * 128, 64 * 128).to(torch.float32)
    codes, scales = quantize_blocks(x)
    want_codes, want_scales = reference(x[:1024, :1024], 128)  # the loop is slow: a corner
    bits_equal(codes[:1024, :1024], want_codes)
    bits_equal(scales[:8, :8], want_scales)
    assert (codes.float().abs().amax() == 448.0).item()
    literal = (x / scales.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448)
    bits_equal(codes, literal.to(torch.float8_e4m3fn))


def test_round_trip_error_is_within_fp8_precision() -> None:
    x = torch.randn(300, 500, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_blocks(x)
    back = dequantize_blocks(codes, scales)
    tile_amax = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :500] * 448
    # e4m3 has 3 mantissa bits: relative step 2^-3 at worst, half of it after rounding
    assert ((back - x).abs() <= tile_amax * 2**-4 + 1e-12).all()


def test_non_contiguous_input() -> None:
    base = sample((300, 400), torch.bfloat16, seed=9)
    x = base[10:270, 33:350:2]  # strided, odd offsets
    codes, scales = quantize_blocks(x)
    want_codes, want_scales = reference(x.contiguous(), 128)
    bits_equal(codes, want_codes)
    bits_equal(scales, want_scales)


def test_rejects_1d() -> None:
    with pytest.raises(ValueError):
        quantize_blocks(torch.zeros(10))


# --- the pack ops ----------------------------------------------------------------------


def _ops(box: Box, shape: tuple[int, ...], block: int = 128) -> tuple[PackOp, PackOp, int, int]:
    lead = box.sizes[:-2]
    ncodes = math.prod(box.sizes)
    nscales = math.prod(lead) * -(-box.sizes[-2] // block) * -(-box.sizes[-1] // block) * 4
    q = PackOp(
        source="w", box=box, transform=Fp8BlockQuant(block=block), staging_offset=0, nbytes=ncodes
    )
    s = PackOp(
        source="w",
        box=box,
        transform=Fp8BlockScale(block=block),
        staging_offset=-(-ncodes // 4) * 4,
        nbytes=nscales,
    )
    return q, s, ncodes, nscales


@pytest.mark.parametrize("use_packer", [True, False])
def test_pack_ops_bitwise(use_packer: bool) -> None:
    local = sample((4, 300, 260), torch.bfloat16, seed=5)
    box = Box(offsets=(1, 128, 0), sizes=(2, 172, 260))
    q, s, ncodes, nscales = _ops(box, local.shape)
    staging = torch.zeros(s.staging_offset + nscales, dtype=torch.uint8)
    if use_packer:
        p = packmod.Packer()
        p.pack(q, local, staging)
        p.pack(s, local, staging)
    else:
        packmod.pack(q, local, staging)
        packmod.pack(s, local, staging)
    want_codes, want_scales = reference(local[1:3, 128:300, 0:260], 128)
    assert torch.equal(staging[:ncodes], want_codes.view(torch.uint8).flatten())
    got_scales = staging[s.staging_offset : s.staging_offset + nscales]
    assert torch.equal(got_scales, want_scales.view(torch.uint8).flatten())


def test_packer_quantizes_once_per_box(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = packmod.quantize_blocks

    def counting(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(x.shape))
        return real(x, block)

    monkeypatch.setattr(packmod, "quantize_blocks", counting)
    local = sample((256, 384), torch.bfloat16, seed=2)
    q, s, _, nscales = _ops(Box.full((256, 384)), local.shape)
    staging = torch.zeros(s.staging_offset + nscales, dtype=torch.uint8)
    p = packmod.Packer()
    p.pack(s, local, staging)  # scales first: the codes come from the same pass
    p.pack(q, local, staging)
    assert calls == [(256, 384)]
    assert len(p) == 0  # both halves used: nothing kept
    # a second version after an in-place update: quantized afresh, not served stale
    first = staging.clone()
    local.mul_(2)
    p.pack(q, local, staging)
    p.pack(s, local, staging)
    assert len(calls) == 2
    assert torch.equal(staging[: q.nbytes], first[: q.nbytes])  # x2 keeps the codes
    scales = staging[s.staging_offset :].view(torch.float32)
    assert torch.equal(scales, first[s.staging_offset :].view(torch.float32) * 2)
    # clear() drops a half nobody asked for
    p.pack(q, local.clone(), staging)
    assert len(p) == 1
    p.clear()
    assert len(p) == 0


def test_module_level_pack_shares_too(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = packmod.quantize_blocks

    def counting(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return real(x, block)

    monkeypatch.setattr(packmod, "quantize_blocks", counting)
    packmod.clear()
    local = sample((130, 140), torch.float32, seed=4)
    q, s, _, nscales = _ops(Box.full((130, 140)), local.shape)
    staging = torch.zeros(s.staging_offset + nscales, dtype=torch.uint8)
    packmod.pack(q, local, staging)
    packmod.pack(s, local, staging)
    assert calls == [1]


def pack_runs_op_by_op(
    p: packmod.Packer,
    ops: tuple[PackOp, ...],
    tensors: dict[str, torch.Tensor],
    got: torch.Tensor,
    runs: int,
) -> torch.Tensor:
    """Packs the bucket `runs` times into `got` through `p` (the tensors scaled in place
    half-way), each run bitwise against packing op by op; the last run's bytes."""
    for run in range(runs):
        if run == runs // 2:
            for t in tensors.values():
                t.mul_(-3)
        want = torch.zeros_like(got)
        one = packmod.Packer()
        for op in ops:
            one.pack(op, tensors[op.source], want)
        got.zero_()
        p.pack_bucket(ops, tensors, got)
        assert torch.equal(got.cpu(), want.cpu()), f"run {run}"
    return want


def _bucket(device: str) -> tuple[tuple[PackOp, ...], dict[str, torch.Tensor], int]:
    """FP8 boxes of two shapes over six tensors (codes and scales in either order), strided
    and contiguous copies, and a cast: the ops of one bucket, laid out one after another."""
    tensors = {
        f"e{i}": sample((300, 260), torch.bfloat16, seed=10 + i).to(device) for i in range(6)
    }
    tensors["norm"] = sample((64, 32), torch.float32, seed=30).to(device)
    ops, offset = [], 0

    def add(source: str, box: Box, transform: object, nbytes: int) -> None:
        nonlocal offset
        offset = -(-offset // 16) * 16
        ops.append(
            PackOp(
                source=source, box=box, transform=transform, staging_offset=offset, nbytes=nbytes
            )
        )  # type: ignore[arg-type]
        offset += nbytes

    for i in range(6):
        for box in (Box.rows((300, 260), 0, 172), Box.rows((300, 260), 172, 300)):
            rows = box.sizes[0]
            codes = (f"e{i}", box, Fp8BlockQuant(block=128), rows * 260)
            scales = (f"e{i}", box, Fp8BlockScale(block=128), -(-rows // 128) * 3 * 4)
            for args in (codes, scales) if i % 2 else (scales, codes):
                add(*args)
        add(f"e{i}", Box.rows((300, 260), 0, 130, dim=1), Copy(), 300 * 130 * 2)  # strided
        add(f"e{i}", Box.rows((300, 260), 7, 20), Copy(), 13 * 260 * 2)  # contiguous
    add("norm", Box.full((64, 32)), Cast(dtype="bfloat16"), 64 * 32 * 2)
    return tuple(ops), tensors, offset


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_pack_bucket_matches_op_by_op(device: str) -> None:
    """The batched bucket path (grouped copies, stacked FP8 quantization, on a GPU a CUDA
    graph from the second run) writes exactly the bytes that packing op by op does, and
    reads the tensors as they are at each run (in-place updates included)."""
    ops, tensors, nbytes = _bucket(device)
    p = packmod.Packer()
    got = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # one staging, as a rank has
    want = pack_runs_op_by_op(p, ops, tensors, got, runs=4)
    (entry,) = p._buckets.values()
    assert (entry.graph is not None) == (device == "cuda")
    assert len(p) == 0
    # other tensor objects: made afresh, never a stale view or graph
    fresh = {k: v.clone() for k, v in tensors.items()}
    got.zero_()
    p.pack_bucket(ops, fresh, got)
    assert torch.equal(got.cpu(), want.cpu())
    assert next(iter(p._buckets.values())) is not entry


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 257), (3, 200, 130), (2, 256, 384)])
def test_cuda_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = sample(shape, dtype, seed=7)
    codes, scales = quantize_blocks(x.cuda())
    assert codes.is_cuda and scales.is_cuda
    want_codes, want_scales = reference(x, 128)
    bits_equal(codes.cpu(), want_codes)
    bits_equal(scales.cpu(), want_scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_at_expert_size() -> None:
    x = sample((4, 2048, 7168), torch.bfloat16, seed=8)
    codes, scales = quantize_blocks(x.cuda())
    want_codes, want_scales = quantize_blocks(x)
    bits_equal(codes.cpu(), want_codes)
    bits_equal(scales.cpu(), want_scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pack_ops() -> None:
    local = sample((4, 300, 260), torch.bfloat16, seed=5).cuda()
    box = Box(offsets=(1, 128, 0), sizes=(2, 172, 260))
    q, s, ncodes, nscales = _ops(box, tuple(local.shape))
    staging = torch.zeros(s.staging_offset + nscales, dtype=torch.uint8, device="cuda")
    p = packmod.Packer()
    p.pack(q, local, staging)
    p.pack(s, local, staging)
    want_codes, want_scales = reference(local[1:3, 128:300, 0:260].cpu(), 128)
    got = staging.cpu()
    assert torch.equal(got[:ncodes], want_codes.view(torch.uint8).flatten())
    assert torch.equal(
        got[s.staging_offset : s.staging_offset + nscales], want_scales.view(torch.uint8).flatten()
    )
