"""FP8 block quantization, the DeepSeek-V3 / DeepGEMM convention.

Every `block`x`block` tile of the last two dimensions (the last tiles may be partial) gets
one float32 scale, the inverse scale SGLang reads as `weight_scale_inv`:

    amax  = max |x| over the tile, in float32, at least 1e-4
    scale = amax / 448
    code  = float8_e4m3fn((float32(x) / scale) clamped to [-448, 448])

One vectorized pass over the whole tensor (zero-pad to whole tiles, view the tiles, take
the amax per tile), on whatever device `x` lives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_blocks(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 2-D or stacked (N-D, tiles on the last two dims) tensor.

    codes: float8_e4m3fn, the shape of `x`. scales: float32, shape
    `(*lead, ceil(R / block), ceil(C / block))`, `scales * codes` approximates `x`.

    Bitwise the same on every device: |x| and its max are exact in x's own dtype (and in
    float32 after), and every division is tensor by tensor, never by a Python number
    (CUDA divides by a scalar as a multiplication by its reciprocal, which can differ in
    the last bit).
    """
    if x.dim() < 2:
        raise ValueError(f"FP8 block quantization needs a 2-D (or stacked) tensor, got {x.dim()}-D")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if not x.is_floating_point():
        raise ValueError(f"FP8 block quantization needs a floating-point tensor, got {x.dtype}")
    if x.dtype == torch.float64:
        x = x.float()  # the convention divides in float32
    *lead, rows, cols = x.shape
    tr, tc = -(-rows // block), -(-cols // block)
    pr, pc = tr * block - rows, tc * block - cols
    padded = F.pad(x, (0, pc, 0, pr)) if (pr or pc) else x  # zeros never raise an amax
    tiles = padded.reshape(*lead, tr, block, tc, block)
    if tiles.numel():
        # one pass over x for both extremes along rows, then a small pass across rows
        lo, hi = torch.aminmax(tiles, dim=-1)
        amax = torch.maximum(hi.amax(dim=-2), -lo.amin(dim=-2)).float()
    else:
        amax = torch.zeros((*lead, tr, tc), dtype=torch.float32, device=x.device)
    scales = amax.clamp_min(AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    # float32(x) / scale, rounded once to e4m3fn on store. The clamp to +-448 is implied:
    # |x| <= amax, so |x| / scale <= 448 * (1 + 2^-22) < 464, and every float32 below 464
    # rounds to at most 448 in e4m3fn, exactly what clamping first gives (the tests check
    # this bitwise against the literal formula, saturated tiles included).
    codes = torch.empty(tiles.shape, dtype=torch.float8_e4m3fn, device=x.device)
    torch.div(tiles, scales[..., :, None, :, None], out=codes)
    codes = codes.view(*lead, tr * block, tc * block)
    if pr or pc:
        codes = codes[..., :rows, :cols].contiguous()
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """float32 approximation of the original tensor (for checks, not on the hot path)."""
    *_, rows, cols = codes.shape
    s = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return codes.float() * s[..., :rows, :cols]
