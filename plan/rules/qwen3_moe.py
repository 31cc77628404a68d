"""Qwen3-MoE: Qwen3 attention (q_norm/k_norm) and routed experts in every layer.

SGLang 0.5.23's Qwen3MoeDecoderLayer treats every layer as sparse (`stage_facts`:
"Qwen3MoE all layers are sparse"), whatever `mlp_only_layers` / `decoder_sparse_step`
say, so a config with dense layers is refused rather than mapped to a layout the engine
does not have. Router `mlp.gate.weight` [E, H] is replicated and never quantized; there
are no shared experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightwire.protocol.errors import PlanError

from . import HfTensor, dense
from .common import Ctx, hf_builder, need
from .moe import experts, hf_experts


def _check(config: Mapping[str, Any]) -> None:
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise PlanError(
            "Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1): "
            "SGLang 0.5.23 builds every Qwen3-MoE layer sparse, so no rules for it"
        )


def hf_tensors(family: str, config: Mapping[str, Any], dtype: str) -> list[HfTensor]:
    _check(config)
    out, add = hf_builder(config, dtype)
    hidden = int(need(config, "hidden_size"))
    n, inter = int(need(config, "num_experts")), int(need(config, "moe_intermediate_size"))
    for i in range(int(need(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        dense.hf_attention("qwen3_moe", config, p, add)
        add(f"{p}.mlp.gate.weight", n, hidden)
        hf_experts(f"{p}.mlp.experts", n, inter, hidden, add)
        dense.hf_layer_norms(config, p, add)
    return dense.hf_ends(config, out, add)


def engine_tensors(ctx: Ctx) -> None:
    _check(ctx.cfg)
    n = int(need(ctx.cfg, "num_experts"))
    dense.embed(ctx)
    for i in range(int(need(ctx.cfg, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        dense.attention(ctx, p)
        ctx.whole(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight")
        experts(ctx, f"{p}.mlp.experts", n)
        dense.layer_norms(ctx, p)
    dense.ends(ctx)
