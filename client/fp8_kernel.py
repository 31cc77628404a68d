"""FP8 block quantization of many 2-D boxes in one launch (Triton), straight into staging.

`Fp8Batch` takes a bucket's FP8 boxes: for each, the source box (any strides, any of the
bucket's tensors), where its codes go and where its scales go (byte offsets into one
staging tensor, -1 where that half is not wanted). It launches one Triton program per
`block`x`block` tile of every box: the program reads its tile once, takes the tile's amax,
writes the float32 scale and the e4m3fn codes at their destination offsets, in the
destination layout (codes row-major in the box's shape, scales row-major per tile). No
stacking, no intermediate tensors, one launch per (source dtype, block size) of a bucket,
so it is captured in the bucket's CUDA graph with the copies.

Bit for bit what `weightwire.client.fp8.quantize_blocks` gives on the same device:

- amax: max |float32(x)| over the tile (exact in any order), taken as the integer max of
  |x|'s bits, so that a tile holding a NaN has a NaN amax (torch's aminmax propagates it);
- scale = max(amax, 1e-4) / 448, an IEEE division (`div_rn`; Triton's `/` is not);
- code = e4m3fn(float32(x) / scale), the division IEEE again and the conversion done with
  integers exactly as c10's `fp8e4m3fn_from_fp32_value` does (round to nearest even,
  subnormals, NaN keeps its sign), so it cannot depend on the hardware's convert
  instruction or on the interpreter.

Two variants of the launch, picked per box when the batch is made:

- aligned (the common case, contiguous rows of whole 16-byte vectors): unit column
  stride, source offset and row stride, codes offset and width all multiples of 16 bytes.
  The descriptor stores them divided by the vector, the kernel multiplies back by a
  constant, so Triton knows the alignment and moves 16 bytes per thread and access
  (without it every element is its own 1- or 2-byte load or store: the 0.07-of-copy-rate
  kernel measured on an H100);
- generic: any strides and offsets (element by element).

The e4m3fn rounding is the hardware's `cvt.rn.satfinite` where the GPU has it (sm_89 on,
`WEIGHTWIRE_FP8_CVT=int` turns it off; a NaN gets c10's sign-keeping code), the integer
formula elsewhere and in the interpreter: the same codes for every quotient the kernel
makes (|q| < 464, so saturation never differs from c10's).

Where it runs: CUDA tensors with Triton installed; CPU tensors only when Triton was
imported under `TRITON_INTERPRET=1` (its interpreter: the CPU tests), and then no CUDA
ones. `available(...)` says whether a set of tensors qualifies; the caller keeps the torch
path for everything else.
`WEIGHTWIRE_FP8_TRITON=0` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path packs every FP8 box
    triton = None
    tl = None

ENABLED = os.environ.get("WEIGHTWIRE_FP8_TRITON", "1") != "0"
HW_CVT = os.environ.get("WEIGHTWIRE_FP8_CVT", "hw") != "int"
# Triton decides at its import whether jit functions (its own library's too) are compiled
# for a GPU or interpreted on the CPU; the kernel follows, and takes tensors accordingly.
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DESC = 8  # int64 fields per box in the descriptor table
_NUM_WARPS = 8


def available(tensors: Sequence[torch.Tensor], block: int) -> bool:
    """Whether the kernel can quantize boxes of these tensors (and write into a staging
    tensor among them) with this block size."""
    if triton is None or not ENABLED or not tensors:
        return False
    if block < 16 or block > 256 or block & (block - 1):  # tl.arange needs a power of two
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = next(iter(devices))
    return device.type == ("cpu" if INTERPRETED else "cuda")


@dataclass(frozen=True)
class Fp8Box:
    """One box to quantize: `src` (a 2-D view, any strides) and its halves' byte offsets
    in staging (-1: not wanted)."""

    src: torch.Tensor
    codes_offset: int
    scales_offset: int


class Fp8Batch:
    """Boxes of one source dtype and block size, quantized into `staging` by one launch.

    The descriptor and tile tables are made once (on the staging's device); `run()`
    queues the launch on the current stream. The boxes' memory must stay where it was.
    """

    def __init__(
        self, boxes: Sequence[Fp8Box], staging: torch.Tensor, block: int, vectors: bool = True
    ) -> None:
        """`vectors`: aligned boxes take the aligned launch (False: all the generic one,
        for comparisons)."""
        if triton is None:
            raise RuntimeError("Triton is not installed")
        dtypes = {b.src.dtype for b in boxes}
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
            raise ValueError(
                f"one source dtype of {DTYPES} per batch, got {sorted(map(str, dtypes))}"
            )
        self.block = block
        self.staging = staging
        self.base = boxes[0].src  # pointer arithmetic is relative to its storage
        self.boxes = tuple(boxes)  # held: their storage must outlive the tables
        item = self.base.element_size()
        self.vec = 16 // item  # elements in 16 bytes
        base_ptr = self.base.data_ptr()
        aligned_bases = vectors and base_ptr % 16 == 0 and staging.data_ptr() % 16 == 0
        parts: dict[bool, tuple[list[int], list[int]]] = {}
        for b in boxes:
            rows, cols = b.src.shape
            delta = b.src.data_ptr() - base_ptr
            if delta % item:
                raise ValueError("a box is not aligned to its element size")
            off, s0, s1 = delta // item, b.src.stride(0), b.src.stride(1)
            aligned = (
                aligned_bases
                and s1 == 1
                and off % self.vec == 0
                and (s0 % self.vec == 0 or rows == 1)
                and cols % 16 == 0
                and (b.codes_offset < 0 or b.codes_offset % 16 == 0)
            )
            desc, tiles = parts.setdefault(aligned, ([], []))
            i = len(desc) // _DESC
            if aligned:  # offsets in vectors: the kernel multiplies them back by constants
                desc += [off // self.vec, rows, cols, s0 // self.vec if rows > 1 else 0, 1]
                desc += [b.codes_offset // 16, b.scales_offset, cols // 16]
            else:
                desc += [off, rows, cols, s0, s1, b.codes_offset, b.scales_offset, 0]
            tr, tc = -(-rows // block), -(-cols // block)
            for ti in range(tr):
                for tj in range(tc):
                    tiles += [i, ti, tj]
        self.launches: list[tuple[bool, torch.Tensor, torch.Tensor, int]] = []
        for aligned, (desc, tiles) in sorted(parts.items()):
            if tiles:
                self.launches.append((
                    aligned,
                    torch.tensor(desc, dtype=torch.int64).to(staging.device),
                    torch.tensor(tiles, dtype=torch.int32).to(staging.device),
                    len(tiles) // 3,
                ))  # fmt: skip
        self.ntiles = sum(n for *_, n in self.launches)
        self.hw_cvt = hw_cvt(staging.device)

    def run(self) -> None:
        """Queue the launches. If the hardware rounding does not compile here, the integer
        formula takes over (for this process), and the launches are queued with it."""
        global HW_CVT
        try:
            self._launch()
        except Exception:
            if not self.hw_cvt:
                raise
            HW_CVT = self.hw_cvt = False
            self._launch()

    def _launch(self) -> None:
        for aligned, desc, tiles, ntiles in self.launches:
            _kernel()[(ntiles,)](
                self.base,
                self.staging,
                desc,
                tiles,
                BLOCK=self.block,
                ALIGNED=aligned,
                VEC=self.vec,
                HW_CVT=self.hw_cvt,
                num_warps=_NUM_WARPS,
            )


def hw_cvt(device: torch.device) -> bool:
    """Whether the kernel rounds to e4m3fn with the GPU's convert instruction (sm_89 on)."""
    if INTERPRETED or not HW_CVT or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_into(boxes: Sequence[Fp8Box], staging: torch.Tensor, block: int = 128) -> None:
    """Quantize `boxes` into `staging` now (batches by source dtype)."""
    by_dtype: dict[torch.dtype, list[Fp8Box]] = {}
    for b in boxes:
        by_dtype.setdefault(b.src.dtype, []).append(b)
    for group in by_dtype.values():
        Fp8Batch(group, staging, block).run()


_KERNEL: list[Any] = []


def _kernel() -> Any:
    """The kernel, jit-compiled on first use (interpreted under TRITON_INTERPRET=1)."""
    if not _KERNEL:
        assert triton is not None
        _KERNEL.append(triton.jit(_quantize))
    return _KERNEL[0]


if triton is not None:

    def _quantize(  # type: ignore[no-untyped-def]
        src,
        dst,
        desc,
        tiles,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
        VEC: tl.constexpr,
        HW_CVT: tl.constexpr,
    ):
        """One program per tile: its box's descriptor, its scale, its codes."""
        pid = tl.program_id(0)
        d = tl.load(tiles + pid * 3).to(tl.int64)
        ti = tl.load(tiles + pid * 3 + 1).to(tl.int64)
        tj = tl.load(tiles + pid * 3 + 2).to(tl.int64)
        at = desc + d * 8
        rows = tl.load(at + 1)
        scales_at = tl.load(at + 6)
        if ALIGNED:  # stored in vectors: multiples of constants, which Triton can see
            off = tl.load(at) * VEC
            s0 = tl.load(at + 3) * VEC
            cols = tl.load(at + 7) * 16
            codes_at = tl.load(at + 5) * 16
        else:
            off = tl.load(at)
            s0 = tl.load(at + 3)
            cols = tl.load(at + 2)
            codes_at = tl.load(at + 5)
        r = ti * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        c = tj * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        if ALIGNED:
            x = tl.load(src + off + r[:, None] * s0 + c[None, :], mask=inside, other=0.0)
        else:
            s1 = tl.load(at + 4)
            x = tl.load(src + off + r[:, None] * s0 + c[None, :] * s1, mask=inside, other=0.0)
        xf = x.to(tl.float32)
        # one reduction for the amax and the NaN test: |x|'s bits order as integers as
        # the values do, and a NaN's bits are above +inf's (0x7F800000)
        amax_bits = tl.max(tl.max(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
        amax = amax_bits.to(tl.float32, bitcast=True)
        floor = tl.full((), 1e-4, tl.float32)
        scale = tl.math.div_rn(tl.maximum(amax, floor), tl.full((), 448.0, tl.float32))
        scale = tl.where(amax_bits > 0x7F800000, float("nan"), scale)
        if scales_at >= 0:  # four bytes: a scale's offset is only 4-aligned in staging
            sbits = scale.to(tl.int32, bitcast=True)
            k = tl.arange(0, 4)
            sb = ((sbits >> (k * 8)) & 0xFF).to(tl.uint8)
            tl.store(dst + scales_at + (ti * ((cols + BLOCK - 1) // BLOCK) + tj) * 4 + k, sb)
        if codes_at >= 0:
            q = tl.math.div_rn(xf, tl.full((BLOCK, BLOCK), 0.0, tl.float32) + scale)
            bits = q.to(tl.int32, bitcast=True)
            neg = bits < 0
            if HW_CVT:  # cvt.rn.satfinite: c10's codes for |q| < 464; NaN keeps its sign
                hw = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
                res = tl.where(q != q, tl.where(neg, 0xFF, 0x7F), hw.to(tl.int32))
            else:
                mag = bits & 0x7FFFFFFF
                # c10's fp8e4m3fn_from_fp32_value, in integers
                den = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
                den = den - (141 << 23)
                nb = mag + ((-120 << 23) + 0x7FFFF) + ((mag >> 20) & 1)
                nrm = (nb >> 20) & 0xFF
                nrm = tl.where(nrm == 0x7F, 0x7E, nrm)
                big = tl.where(mag > 0x7F800000, 0x7F, 0x7E)
                res = tl.where(mag >= (1087 << 20), big, tl.where(mag < (121 << 23), den, nrm))
                res = res | tl.where(neg, 0x80, 0)
            out = dst + codes_at + (r[:, None] * cols + c[None, :])
            tl.store(out, res.to(tl.uint8), mask=inside)
