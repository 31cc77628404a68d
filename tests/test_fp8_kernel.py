"""The Triton FP8 kernel (`client/fp8_kernel.py`) bit for bit against `quantize_blocks`.

On CPU it runs through Triton's interpreter: small shapes, ragged
edges, strided boxes, zero tiles, inf and NaN, several tensors and dtypes in one launch,
codes or scales alone. Triton picks the interpreter when it is imported, so without
TRITON_INTERPRET=1 in the environment these tests run in a pytest of their own that has
it (`test_cpu_tests_through_the_interpreter`). The GPU tests (`-m gpu`) run the compiled
kernel, and a bucket's packs through it inside the bucket's CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from weightwire.client import buckets as bucketsmod
from weightwire.client import fp8_kernel
from weightwire.client import pack as packmod
from weightwire.client.fp8 import quantize_blocks
from weightwire.client.fp8_kernel import Fp8Box, quantize_into

from .interpreted import CUDA, INTERP, NEEDS_TRITON, OUTSIDE, run_interpreted
from .test_fp8 import _bucket, pack_runs_op_by_op, sample

pytestmark = NEEDS_TRITON


@OUTSIDE
def test_cpu_tests_through_the_interpreter() -> None:
    run_interpreted(__file__, "WEIGHTWIRE_FP8_TRITON", r"3\d", timeout_s=900)


def _same_scales(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise, except that a NaN scale (a tile holding a NaN) only has to be a NaN:
    torch's own NaN payload differs by dtype and device (0x7fc00000 or 0x7fffffff)."""
    g, w = got.view(torch.float32), want.view(torch.float32)
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(g), nan)
    assert torch.equal(g.view(torch.int32)[~nan], w.view(torch.int32)[~nan])


def _check(
    xs: list[torch.Tensor],
    block: int = 128,
    want: tuple[bool, bool] = (True, True),
    device: str = "cpu",
) -> None:
    """Quantize every x into one staging in one call (odd gaps between the parts) and
    compare with quantize_blocks of each; bytes in the gaps stay untouched."""
    layout, off = [], 7
    for x in xs:
        codes_at = off if want[0] else -1
        off += x.numel() + 5 if want[0] else 0
        off = -(-off // 4) * 4
        scales_at = off if want[1] else -1
        n_scales = -(-x.shape[0] // block) * -(-x.shape[1] // block) * 4
        off += n_scales + 3 if want[1] else 0
        layout.append((codes_at, scales_at, n_scales))
    staging = torch.full((off + 9,), 0xA5, dtype=torch.uint8, device=device)
    quantize_into(
        [Fp8Box(x, c, s) for x, (c, s, _) in zip(xs, layout, strict=True)], staging, block
    )
    got = staging.cpu()
    touched = torch.zeros_like(got, dtype=torch.bool)
    for x, (codes_at, scales_at, n_scales) in zip(xs, layout, strict=True):
        codes, scales = quantize_blocks(x, block)
        if codes_at >= 0:
            part = got[codes_at : codes_at + x.numel()]
            assert torch.equal(part, codes.cpu().view(torch.uint8).flatten())
            touched[codes_at : codes_at + x.numel()] = True
        if scales_at >= 0:
            _same_scales(got[scales_at : scales_at + n_scales], scales.cpu().flatten())
            touched[scales_at : scales_at + n_scales] = True
    assert (got[~touched] == 0xA5).all()


def _aligned(
    xs: list[torch.Tensor], block: int = 128, device: str = "cpu"
) -> tuple[fp8_kernel.Fp8Batch, torch.Tensor, list[tuple[int, int, int]]]:
    """The boxes laid out as the planner does (16-byte aligned codes, then scales), in
    one batch run once; (batch, staging, (codes, scales, scale bytes) per box)."""
    layout, off = [], 256
    for x in xs:
        codes_at = off
        off = -(-(off + x.numel()) // 16) * 16
        n_scales = -(-x.shape[0] // block) * -(-x.shape[1] // block) * 4
        layout.append((codes_at, off, n_scales))
        off = -(-(off + n_scales) // 16) * 16 + 16
    staging = torch.full((off,), 0xA5, dtype=torch.uint8, device=device)
    batch = fp8_kernel.Fp8Batch(
        [Fp8Box(x, c, s) for x, (c, s, _) in zip(xs, layout, strict=True)], staging, block
    )
    batch.run()
    return batch, staging, layout


def _check_aligned(xs: list[torch.Tensor], block: int = 128, device: str = "cpu") -> list[bool]:
    """As `_check`, for boxes laid out as planned; returns which launches ran (aligned?)."""
    batch, staging, layout = _aligned(xs, block, device)
    got = staging.cpu()
    touched = torch.zeros_like(got, dtype=torch.bool)
    for x, (codes_at, scales_at, n_scales) in zip(xs, layout, strict=True):
        codes, scales = quantize_blocks(x, block)
        assert torch.equal(
            got[codes_at : codes_at + x.numel()], codes.cpu().view(torch.uint8).flatten()
        )
        _same_scales(got[scales_at : scales_at + n_scales], scales.cpu().flatten())
        touched[codes_at : codes_at + x.numel()] = True
        touched[scales_at : scales_at + n_scales] = True
    assert (got[~touched] == 0xA5).all()
    return [a for a, *_ in batch.launches]


@INTERP
@pytest.mark.parametrize(
    "variant", [n for n, v in fp8_kernel.VARIANTS.items() if not v.fast_div and n != "whole-w8"]
)
def test_every_variant_bitwise(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launch variant (rows at a time, warps) gives the same bytes, aligned and
    generic boxes, ragged edges, zero / inf / NaN tiles."""
    monkeypatch.setattr(fp8_kernel, "CHOICE", variant)
    e = sample((2, 200, 272), torch.bfloat16, seed=21)
    e[0, :128, :128] = 0
    e[1, 3, 3] = float("inf")
    e[1, 150, 200] = float("nan")
    assert _check_aligned([*e, e[0].t(), e[1, 7:190, 16:160]]) == [False, True]
    batch, *_ = _aligned([e[0]])
    assert batch.variant.name == variant


@INTERP
def test_aligned_boxes_take_the_vector_launch_bitwise() -> None:
    """Contiguous rows of whole 16-byte vectors (stacked experts, row and column ranges of
    them) go to the aligned launch, the rest (a transposed view, odd widths) to the
    generic one, in one batch; both bitwise, ragged edges and odd values included."""
    e = sample((4, 200, 272), torch.bfloat16, seed=11)
    e[1, :128, :128] = 0
    e[2, 3, 5] = float("nan")
    e[2, 150, 260] = float("-inf")
    e[3, 199, 271] = float("inf")
    e[0, 130:, :] = 448 * 2**-9
    xs = [e[0], e[1], e[2], e[3], e[1, 8:100], e[2, :, 16:48], e[3, :, :40], e[0, :64, :64].t()]
    assert _check_aligned(xs) == [False, True]
    assert _check_aligned([e[0].float(), e[1].half()[:, :256]][:1]) == [True]
    assert _check_aligned([e[1, 8:100]]) == [True]


@INTERP
def test_hardware_rounding_that_fails_falls_back_to_integers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU whose Triton cannot compile the e4m3fn convert: the batch relaunches with the
    integer formula (and so does every later one), bitwise."""
    real = fp8_kernel._kernel()

    class NoCvt:
        def __getitem__(self, grid: tuple[int]) -> object:
            def launch(*args: object, **kw: object) -> object:
                if kw["HW_CVT"]:
                    raise RuntimeError("no e4m3fn convert here")
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(fp8_kernel, "_kernel", NoCvt)
    monkeypatch.setattr(fp8_kernel, "HW_CVT", True)
    x = sample((130, 256), torch.bfloat16, seed=14)
    staging = torch.zeros(x.numel() + 16 + 2 * 2 * 4, dtype=torch.uint8)
    batch = fp8_kernel.Fp8Batch([Fp8Box(x, 0, x.numel() + 16)], staging, 128)
    batch.hw_cvt = True  # as on an sm_90 GPU
    batch.run()
    assert not batch.hw_cvt and not fp8_kernel.HW_CVT
    codes, scales = quantize_blocks(x, 128)
    assert torch.equal(staging[: x.numel()], codes.view(torch.uint8).flatten())
    _same_scales(staging[x.numel() + 16 :], scales.flatten())


@INTERP
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (128, 128), (130, 257), (129, 127)])
def test_ragged_shapes(shape: tuple[int, int], dtype: torch.dtype) -> None:
    _check([sample(shape, dtype, seed=sum(shape))])


@INTERP
def test_many_boxes_one_launch_strided_and_contiguous() -> None:
    """Boxes of different tensors, shapes and strides (a row range, a column slice, a
    transposed view) in one batch."""
    a = sample((300, 260), torch.bfloat16, seed=1)
    b = sample((4, 140, 200), torch.bfloat16, seed=2)
    xs = [a[:172], a[172:], a[:, 130:], a[5:200, 3:250], b[1], b[3, :, :70], a[:140, :100].t()]
    assert not xs[2].is_contiguous() and not xs[-1].is_contiguous()
    _check(xs)


@INTERP
@pytest.mark.parametrize("want", [(True, False), (False, True)])
def test_codes_or_scales_alone(want: tuple[bool, bool]) -> None:
    _check(
        [sample((130, 140), torch.bfloat16, seed=3), sample((9, 300), torch.bfloat16, 4)], want=want
    )


@INTERP
@pytest.mark.parametrize("block", [16, 64])
def test_other_block_sizes(block: int) -> None:
    _check([sample((70, 45), torch.float32, seed=block)], block=block)


@INTERP
def test_zero_tiny_inf_nan_and_negative_zero() -> None:
    x = sample((260, 390), torch.bfloat16, seed=5)
    x[:128, :128] = 0  # a zero tile: the floor scale
    x[:128, 128:256] = -0.0
    x[128:256, :128] = 1e-30  # tiny: the floor, codes round to zero
    x[0, 300] = float("inf")  # an inf tile: scale inf, codes 0 and NaN (inf/inf)
    x[130, 300] = float("-inf")
    x[200, 200] = float("nan")  # a NaN tile: scale NaN, codes NaN
    x[259, 389] = float("nan")  # in a ragged corner tile
    x[256:, :128] = 448 * 2**-9  # codes at the e4m3fn subnormal boundary
    _check([x])
    _check([x.float()])


@INTERP
def test_wide_range_near_saturation() -> None:
    """Every tile's extreme element maps to +-448 exactly; the rest spans many binades,
    subnormal codes included."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn((256, 256), generator=g) * torch.exp(torch.randn((256, 256), generator=g) * 6)
    _check([x, x.to(torch.bfloat16), -x])


@INTERP
def test_bucket_pack_runs_the_kernel_bitwise() -> None:
    """A bucket through BucketPack: FP8 boxes go to the kernel (one batch for the bucket's
    bf16 sources), the bytes equal packing op by op through torch, run after run."""
    ops, tensors, nbytes = _bucket("cpu")
    p = packmod.Packer()
    pack_runs_op_by_op(p, ops, tensors, torch.zeros(nbytes, dtype=torch.uint8), runs=2)
    (entry,) = p._buckets.values()
    assert len(entry.kernel) == 1 and not entry.fp8
    assert entry.kernel[0].ntiles == 6 * (2 * 3 + 1 * 3)
    assert entry.plain is not None and len(entry.plain.pairs) == 6  # the contiguous copies


@INTERP
def test_torch_path_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_kernel, "ENABLED", False)
    ops, tensors, nbytes = _bucket("cpu")
    p = packmod.Packer()
    got = torch.zeros(nbytes, dtype=torch.uint8)
    p.pack_bucket(ops, tensors, got)
    (entry,) = p._buckets.values()
    assert not entry.kernel and entry.fp8


@INTERP
def test_a_failing_kernel_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(fp8_kernel.Fp8Batch, "run", boom)
    monkeypatch.setattr(bucketsmod, "_kernel_failed", False)
    ops, tensors, nbytes = _bucket("cpu")
    want = torch.zeros(nbytes, dtype=torch.uint8)
    one = packmod.Packer()
    for op in ops:
        one.pack(op, tensors[op.source], want)
    got = torch.zeros(nbytes, dtype=torch.uint8)
    p = packmod.Packer()
    p.pack_bucket(ops, tensors, got)
    assert torch.equal(got, want)
    (entry,) = p._buckets.values()
    assert not entry.kernel and entry.fp8
    assert bucketsmod._kernel_failed


# --- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@CUDA
def test_cuda_kernel_bitwise() -> None:
    torch.cuda.manual_seed(0)
    a = sample((2 * 2048, 7168), torch.bfloat16, seed=8).cuda()
    b = sample((3, 1000, 777), torch.float32, seed=9).cuda()
    x = sample((260, 390), torch.bfloat16, seed=5).cuda()
    x[:128, :128] = 0
    x[0, 300] = float("inf")
    x[200, 200] = float("nan")
    _check([a[:2048], a[2048:], a[:, 1000:3000], b[1], b[2, :, 5:], x], device="cuda")
    # and the compiled kernel agrees with torch on the CPU too (the kernel runs where its
    # tensors are: the GPU's bytes against quantize_blocks of a CPU copy)
    x = a[:300, :400]
    n_scales = 3 * 4 * 4
    staging = torch.zeros(x.numel() + n_scales, dtype=torch.uint8, device="cuda")
    quantize_into([Fp8Box(x, 0, x.numel())], staging, 128)
    codes, scales = quantize_blocks(x.cpu(), 128)
    got = staging.cpu()
    assert torch.equal(got[: x.numel()], codes.view(torch.uint8).flatten())
    _same_scales(got[x.numel() :], scales.flatten())


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("cvt", [True, False])
@pytest.mark.parametrize("variant", list(fp8_kernel.VARIANTS))
def test_cuda_aligned_launch_bitwise(
    cvt: bool, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert-shaped boxes (the colocated bench's) through the aligned launch, rounding
    by the hardware's convert (sm_89 on) and by the integer formula, each launch variant
    (the reciprocal division's too): bitwise, edge values in a tile each (zero, NaN,
    +-inf, e4m3fn subnormals, a wide range, values below 2**-40, tiles above 2**80)."""
    monkeypatch.setattr(fp8_kernel, "HW_CVT", cvt)
    monkeypatch.setattr(fp8_kernel, "CHOICE", variant)
    e = sample((6, 768, 2048), torch.bfloat16, seed=12).cuda()
    e[0, :128, :128] = 0
    e[1, 5, 7] = float("nan")
    e[1, 300, 1000] = -float("nan")
    e[2, 140, 140] = float("inf")
    e[2, 400, 400] = float("-inf")
    e[3, 128:256, :128] = 448 * 2**-9
    g = torch.Generator().manual_seed(13)
    wide = torch.randn((768, 2048), generator=g) * torch.exp(
        torch.randn((768, 2048), generator=g) * 6
    )
    e[4] = wide.to(torch.bfloat16).cuda()
    e[5, :128, 128:256] *= 2.0**-45  # below the reciprocal's tiny cut, zeros' signs
    e[5, 128:256, 128:256] *= 2.0**90  # above its 2**80 tile cut
    e[5, 256, 300] = -0.0
    e[5, 256:384, 512:640] *= 2.0**-45  # a tile of values below 2**-40 of both signs, and
    e[5, 300, 600] = 1.0  # zeros of both signs, under a normal amax (the finite variants)
    e[5, 310, 610], e[5, 311, 611] = 0.0, -0.0
    assert _check_aligned([*e, e[5, 64:700, 256:1024]], device="cuda") == [True]
    assert _check_aligned([e[4].float(), e[1].float()], device="cuda") == [True]
    batch, *_ = _aligned([e[0]], device="cuda")
    assert batch.hw_cvt == (cvt and torch.cuda.get_device_capability() >= (8, 9))
    assert batch.variant.name == variant


@pytest.mark.gpu
@CUDA
def test_cuda_tune_picks_a_variant_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("tune"): the first batch times every variant (each bitwise against the
    default's, or not a candidate), later batches reuse the pick."""
    monkeypatch.setattr(fp8_kernel, "CHOICE", "tune")
    monkeypatch.setattr(fp8_kernel, "_TUNED", {})
    monkeypatch.setattr(fp8_kernel, "TUNE_LOG", {})
    e = sample((2, 768, 2048), torch.bfloat16, seed=14).cuda()
    assert _check_aligned([*e], device="cuda") == [True]
    (log,) = fp8_kernel.TUNE_LOG.values()
    assert set(log) == set(fp8_kernel.VARIANTS)
    (picked,) = fp8_kernel._TUNED.values()
    assert log[picked] == min(log.values()) < float("inf")
    batch, *_ = _aligned([e[0]], device="cuda")
    assert batch.variant.name == picked


@pytest.mark.gpu
@CUDA
def test_cuda_bucket_in_its_graph() -> None:
    """The bucket's FP8 launches are captured in its CUDA graph with the copies; replays
    read the tensors as they are (in-place updates), bitwise against op by op."""
    ops, tensors, nbytes = _bucket("cuda")
    p = packmod.Packer()
    pack_runs_op_by_op(
        p, ops, tensors, torch.zeros(nbytes, dtype=torch.uint8, device="cuda"), runs=4
    )
    (entry,) = p._buckets.values()
    assert entry.kernel and not entry.fp8 and entry.graph is not None
