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
- code = e4m3fn(float32(x) / scale), the division IEEE again (or, in the `fast_div`
  variants, x times RN(1/scale) corrected twice by fused multiply-adds: Markstein's
  theorem makes that the IEEE quotient where nothing leaves float32's normal range, so
  tiles with amax >= 2**80, inf or NaN divide as before, |x| < 2**-40 codes as a signed
  zero) and the conversion done with
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

from . import fp8_triton
from .lazyjit import LazyKernel

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


@dataclass(frozen=True)
class Variant:
    """One way to launch the kernel (the same codes from each): `step` rows of a tile at a
    time (the block: the whole tile at once), `num_warps`, `fast_div` (the quotient by a
    per-tile reciprocal and two exact corrections instead of an IEEE division per element;
    compiled GPUs only: the interpreter has no fused multiply-add)."""

    name: str
    step: int  # 0: the whole tile
    num_warps: int
    fast_div: bool = False
    finite: bool = False  # the whole tile: `fp8_triton._codes_finite` where it qualifies


VARIANTS = {v.name: v for v in (
    Variant("whole-w8", 0, 8),  # the kernel before these variants
    Variant("whole-w4", 0, 4),
    Variant("rows32-w4", 32, 4),
    Variant("rows32-w8", 32, 8),
    Variant("rows64-w8", 64, 8),
    Variant("whole-w8-fdiv", 0, 8, True),
    Variant("rows32-w4-fdiv", 32, 4, True),
    Variant("rows64-w8-fdiv", 64, 8, True),
    Variant("whole-w8-finite", 0, 8, True, True),
    Variant("whole-w16-finite", 0, 16, True, True),
)}  # fmt: skip
DEFAULT = "whole-w8"
# `WEIGHTWIRE_FP8_VARIANT`: a name above (every batch uses it), or "tune" (the default on
# a GPU): the first batch of a (device, dtype, block) times each candidate once on scratch
# tiles, checks its bytes against the default's, and every later batch takes the fastest.
CHOICE = os.environ.get("WEIGHTWIRE_FP8_VARIANT", "tune")
_TUNED: dict[tuple[Any, ...], str] = {}
TUNE_LOG: dict[tuple[Any, ...], dict[str, float]] = {}  # candidate name -> ms (or inf)


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
        self,
        boxes: Sequence[Fp8Box],
        staging: torch.Tensor,
        block: int,
        vectors: bool = True,
        variant: str | None = None,
    ) -> None:
        """`vectors`: aligned boxes take the aligned launch (False: all the generic one,
        for comparisons). `variant`: a name of `VARIANTS` (None: `WEIGHTWIRE_FP8_VARIANT`,
        tuned once per device, dtype and block size where that says "tune")."""
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
                and block * (max(s0, cols) + 1) < 2**31  # offsets in a tile fit int32
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
        self.variant = VARIANTS[variant or _choose(self.base.dtype, staging, block)]
        if INTERPRETED and self.variant.fast_div:
            self.variant = VARIANTS[DEFAULT]

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
                STEP=min(self.variant.step or self.block, self.block),
                ALIGNED=aligned,
                VEC=self.vec,
                HW_CVT=self.hw_cvt,
                FAST_DIV=self.variant.fast_div,
                FINITE=self.variant.finite and (self.variant.step or self.block) >= self.block,
                num_warps=self.variant.num_warps,
            )


def _choose(dtype: torch.dtype, staging: torch.Tensor, block: int) -> str:
    """The variant for batches of this source dtype and block size on staging's device."""
    if CHOICE in VARIANTS:
        return CHOICE
    if CHOICE != "tune" or INTERPRETED or staging.device.type != "cuda":
        return DEFAULT
    key = (staging.device, dtype, block, hw_cvt(staging.device))
    if key not in _TUNED:
        _TUNED[key] = tune(dtype, staging.device, block)
    return _TUNED[key]


def tune(dtype: torch.dtype, device: torch.device, block: int, mib: int = 48) -> str:
    """The fastest variant on `mib` MiB of scratch tiles (random values, every bf16 bit
    pattern among them, a tile with an inf, one with a NaN, one of zeros): each compiled and
    run once, then timed on two runs between CUDA events; one whose bytes differ from the
    default's is never picked. Once per (device, dtype, block) and process: the first FP8
    bucket's pack (made before its graph is captured)."""
    cols = 2048
    rows = max(block, (mib << 20) // (cols * torch.finfo(dtype).bits // 8) // block * block)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, cols), generator=g, device=device, dtype=torch.float32)
    x = x * torch.exp2(torch.randint(-30, 8, (rows, 1), generator=g, device=device))
    x = x.to(dtype)
    if dtype == torch.bfloat16:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device)
        x.view(-1)[: 2**16] = every.to(torch.int16).view(torch.bfloat16)
    x[block : 2 * block, :block] = 0
    x[2 * block, block] = float("inf")
    x[2 * block, 2 * block] = float("nan")
    tiles = (rows // block) * (cols // block)
    staging = torch.empty(rows * cols + tiles * 4 + 16, dtype=torch.uint8, device=device)
    box = [Fp8Box(x, 0, rows * cols)]
    want: torch.Tensor | None = None
    log = TUNE_LOG.setdefault((device, dtype, block), {})
    best, best_ms = DEFAULT, float("inf")
    for name in [DEFAULT, *[n for n in VARIANTS if n != DEFAULT]]:
        try:
            b = Fp8Batch(box, staging, block, variant=name)
            staging.zero_()
            b.run()
            # this stream only, not the device: another rank's thread may be capturing a
            # bucket's graph on a stream of its own (a device-wide sync would take in, and
            # invalidate, that capture)
            torch.cuda.current_stream(device).synchronize()
            if want is None:
                want = staging.clone()
            elif not torch.equal(staging, want):  # the NaN scale too: one constant
                log[name] = float("inf")
                continue
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            b.run()
            b.run()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 2
        except Exception:  # a variant that does not compile here is not a candidate
            log[name] = float("inf")
            continue
        log[name] = ms
        if ms < best_ms:
            best, best_ms = name, ms
    return best


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


_kernel = LazyKernel(lambda: fp8_triton.quantize)  # its name (`_quantize`) shows in profiles
