"""Running a bucket's pack ops: this rank's tensors into the staging bytes, in the
engine's layout. Slices and casts here; FP8 block quantization in `recipes`."""

from __future__ import annotations

import torch

from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Cast, Copy, Fp8BlockQuant, Fp8BlockScale

from .dtypes import TORCH


def box_of(t: torch.Tensor, op: PackOp) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(op.box.offsets, op.box.sizes, strict=True))]


def pack(op: PackOp, local: torch.Tensor, staging: torch.Tensor) -> None:
    """Write op's bytes into `staging` (a flat uint8 tensor on any device)."""
    src = box_of(local, op)
    out = staging[op.staging_offset : op.staging_offset + op.nbytes]
    match op.transform:
        case Copy():
            out.view(src.dtype).view(src.shape).copy_(src)
        case Cast(dtype=dtype):
            out.view(TORCH[dtype]).view(src.shape).copy_(src)
        case Fp8BlockQuant(block=block):
            from .fp8 import quantize_blocks

            codes, _ = quantize_blocks(src, block)
            out.view(codes.dtype).view(codes.shape).copy_(codes)
        case Fp8BlockScale(block=block):
            from .fp8 import quantize_blocks

            _, scales = quantize_blocks(src, block)
            out.view(torch.float32).view(scales.shape).copy_(scales)
