"""Random HF-named weights, the same for a seed in every test that draws them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from weightwire.client.dtypes import TORCH
from weightwire.plan.rules import hf_tensors


def random_weights(
    shapes: Iterable[tuple[str, tuple[int, ...], str]], seed: int = 0
) -> dict[str, torch.Tensor]:
    """(name, shape, dtype) -> a tensor of normal values scaled by 1 to 5, so FP8 blocks
    get scales of their own."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in shapes:
        x = torch.randn(shape, generator=g) * (1 + 4 * torch.rand(shape, generator=g))
        out[name] = x.to(TORCH[dtype])
    return out


def random_hf(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model's HF checkpoint, as the model-family rules list them."""
    return random_weights(((t.name, t.shape, t.dtype) for t in hf_tensors(cfg)), seed)
