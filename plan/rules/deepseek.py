"""DeepSeek-V3 and Kimi-K2 (`model_type: kimi_k2`, same SGLang class): MLA attention,
`first_k_dense_replace` dense layers, then MoE layers with shared experts.

SGLang 0.5.23 (`models/deepseek_v2.py`, `deepseek_common/`), engine rank r of tp:

- `self_attn.fused_qkv_a_proj_with_mqa.weight` = [q_a_proj; kv_a_proj_with_mqa],
  replicated (q_lora_rank set); without q_lora_rank: `q_proj` column-parallel by heads
  and `kv_a_proj_with_mqa` replicated. `q_a_layernorm`, `kv_a_layernorm` whole.
- `q_b_proj`, `kv_b_proj`: rows of this rank's heads; `o_proj`: its heads' columns.
- Dense layers (layer < first_k_dense_replace, or layer % moe_layer_freq != 0) and
  `mlp.shared_experts`: gate_up/down TP-sharded over all tp, like a dense MLP.
- MoE layers: router `mlp.gate.weight` [E, H] replicated (never quantized),
  `mlp.gate.e_score_correction_bias` [E] float32 (noaux_tc), routed experts (moe.py).

Not covered, on purpose:
- Derived tensors that `post_load_weights` computes from `kv_b_proj`: `self_attn.w_kc`,
  `self_attn.w_vc` (and FP8 `self_attn.w_scale`). They are plain attributes, not
  parameters; after writing `kv_b_proj` in place the engine must recompute them.
- Shared-expert fusion (a CUDA engine with 256 routed experts, 1 shared, ep 1 puts the
  shared expert in slot E of `experts.w13_weight`): the rules assume it is off.
  A fused engine declares `w13_weight` with one more expert, and resolve says so.
- A2A MoE backends (DeepEP, ...) replicate the shared experts: assumed off.
- MTP / next-n layers (`num_nextn_predict_layers`): not in the main model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import HfTensor, dense
from .common import Ctx, hf_builder, need, split
from .moe import experts, hf_experts


def _sparse(config: Mapping[str, Any], layer: int) -> bool:
    return (
        config.get("n_routed_experts") is not None
        and layer >= int(config.get("first_k_dense_replace") or 0)
        and layer % int(config.get("moe_layer_freq") or 1) == 0
    )


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, int | None]:
    return (
        int(need(config, "num_attention_heads")),
        int(need(config, "qk_nope_head_dim")),
        int(need(config, "qk_rope_head_dim")),
        int(need(config, "v_head_dim")),
        int(need(config, "kv_lora_rank")),
        int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
    )


def _has_bias(config: Mapping[str, Any]) -> bool:
    return config.get("topk_method") == "noaux_tc"


def hf_tensors(family: str, config: Mapping[str, Any], dtype: str) -> list[HfTensor]:
    out, add = hf_builder(config, dtype)
    hidden = int(need(config, "hidden_size"))
    nh, nope, rope, vd, kvl, ql = _dims(config)
    for i in range(int(need(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if ql:
            add(f"{a}.q_a_proj.weight", ql, hidden)
            add(f"{a}.q_a_layernorm.weight", ql)
            add(f"{a}.q_b_proj.weight", nh * (nope + rope), ql)
        else:
            add(f"{a}.q_proj.weight", nh * (nope + rope), hidden)
        add(f"{a}.kv_a_proj_with_mqa.weight", kvl + rope, hidden)
        add(f"{a}.kv_a_layernorm.weight", kvl)
        add(f"{a}.kv_b_proj.weight", nh * (nope + vd), kvl)
        add(f"{a}.o_proj.weight", hidden, nh * vd)
        if _sparse(config, i):
            n, inter = (
                int(need(config, "n_routed_experts")),
                int(need(config, "moe_intermediate_size")),
            )
            add(f"{p}.mlp.gate.weight", n, hidden)
            if _has_bias(config):
                add(f"{p}.mlp.gate.e_score_correction_bias", n, dt="float32")
            hf_experts(f"{p}.mlp.experts", n, inter, hidden, add)
            shared = int(config.get("n_shared_experts") or 0)
            if shared:
                dense.hf_mlp(config, f"{p}.mlp.shared_experts", inter * shared, add)
        else:
            dense.hf_mlp(config, f"{p}.mlp", int(need(config, "intermediate_size")), add)
        dense.hf_layer_norms(config, p, add)
    return dense.hf_ends(config, out, add)


def attention(ctx: Ctx, p: str) -> None:
    nh, nope, rope, vd, _, ql = _dims(ctx.cfg)
    a = f"{p}.self_attn"
    hlo, hhi = split(nh, ctx.tp, ctx.rank, "num_attention_heads")
    if ql:
        ctx.linear(
            f"{a}.fused_qkv_a_proj_with_mqa.weight",
            [ctx.full(f"{a}.q_a_proj.weight"), ctx.full(f"{a}.kv_a_proj_with_mqa.weight")],
        )
        ctx.whole(f"{a}.q_a_layernorm.weight", f"{a}.q_a_layernorm.weight")
        q = "q_b_proj"
    else:
        ctx.linear(f"{a}.kv_a_proj_with_mqa.weight", [ctx.full(f"{a}.kv_a_proj_with_mqa.weight")])
        q = "q_proj"
    qd = nope + rope
    ctx.linear(f"{a}.{q}.weight", [ctx.rows(f"{a}.{q}.weight", hlo * qd, hhi * qd)])
    kd = nope + vd
    ctx.linear(f"{a}.kv_b_proj.weight", [ctx.rows(f"{a}.kv_b_proj.weight", hlo * kd, hhi * kd)])
    ctx.linear(f"{a}.o_proj.weight", [ctx.cols(f"{a}.o_proj.weight", hlo * vd, hhi * vd)])
    ctx.whole(f"{a}.kv_a_layernorm.weight", f"{a}.kv_a_layernorm.weight")


def engine_tensors(ctx: Ctx) -> None:
    cfg = ctx.cfg
    dense.embed(ctx)
    for i in range(int(need(cfg, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        attention(ctx, p)
        if _sparse(cfg, i):
            ctx.whole(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight")
            if _has_bias(cfg):
                b = f"{p}.mlp.gate.e_score_correction_bias"
                ctx.whole(b, b, dtype="float32")
            experts(ctx, f"{p}.mlp.experts", int(need(cfg, "n_routed_experts")))
            if int(cfg.get("n_shared_experts") or 0):
                dense.mlp(ctx, f"{p}.mlp.shared_experts")
        else:
            dense.mlp(ctx, f"{p}.mlp")
        dense.layer_norms(ctx, p)
    dense.ends(ctx)
