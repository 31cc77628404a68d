"""Llama, Qwen2 and Qwen3 dense models (and the parts Qwen3-MoE shares with them).

SGLang 0.5.23 (`models/llama.py`, `qwen2.py`, `qwen3.py`), engine rank r of tp:

- `self_attn.qkv_proj.weight` = [q heads r·nh/tp..; k heads; v heads] on dim 0. KV heads:
  tp <= n_kv: n_kv/tp contiguous heads; tp > n_kv: one head, r // (tp/n_kv), replicated
  over tp/n_kv consecutive ranks. Qwen2 (and `attention_bias`): `qkv_proj.bias` the same.
- `self_attn.o_proj.weight`, `mlp.down_proj.weight`: row-parallel, dim 1 sliced;
  `o_proj.bias` (Llama/Qwen3 with `attention_bias`) whole.
- `mlp.gate_up_proj.weight` = [gate slice r; up slice r].
- Qwen3: `self_attn.q_norm`/`k_norm` [head_dim], whole. Norms whole.
- `model.embed_tokens.weight`, `lm_head.weight`: vocab-parallel, padded (common.vocab).
  Tied embeddings: the checkpoint has no `lm_head.weight` and SGLang's
  `named_parameters()` lists only `model.embed_tokens.weight` (lm_head is that module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from weightwire.protocol.errors import PlanError

from . import HfTensor
from .common import Ctx, head_dim, hf_builder, need, optional, split

Add = Callable[..., None]


def has_qkv_bias(family: str, config: Mapping[str, Any]) -> bool:
    return family == "qwen2" or bool(config.get("attention_bias"))


def has_o_bias(family: str, config: Mapping[str, Any]) -> bool:
    # Qwen2's o_proj never has a bias; Llama/Qwen3/Qwen3-MoE follow attention_bias.
    return family != "qwen2" and bool(config.get("attention_bias"))


def tied(config: Mapping[str, Any]) -> bool:
    return bool(config.get("tie_word_embeddings", False))


# --------------------------------------------------------------------------- HF names
def hf_attention(family: str, config: Mapping[str, Any], p: str, add: Add) -> None:
    hidden, nh = int(need(config, "hidden_size")), int(need(config, "num_attention_heads"))
    nkv = optional(config, "num_key_value_heads", nh)
    hd = head_dim(config)
    a = f"{p}.self_attn"
    add(f"{a}.q_proj.weight", nh * hd, hidden)
    add(f"{a}.k_proj.weight", nkv * hd, hidden)
    add(f"{a}.v_proj.weight", nkv * hd, hidden)
    add(f"{a}.o_proj.weight", hidden, nh * hd)
    if has_qkv_bias(family, config):
        add(f"{a}.q_proj.bias", nh * hd)
        add(f"{a}.k_proj.bias", nkv * hd)
        add(f"{a}.v_proj.bias", nkv * hd)
    if has_o_bias(family, config):
        add(f"{a}.o_proj.bias", hidden)
    if family in ("qwen3", "qwen3_moe"):
        add(f"{a}.q_norm.weight", hd)
        add(f"{a}.k_norm.weight", hd)


def hf_mlp(config: Mapping[str, Any], p: str, inter: int, add: Add) -> None:
    hidden = int(need(config, "hidden_size"))
    add(f"{p}.gate_proj.weight", inter, hidden)
    add(f"{p}.up_proj.weight", inter, hidden)
    add(f"{p}.down_proj.weight", hidden, inter)


def hf_layer_norms(config: Mapping[str, Any], p: str, add: Add) -> None:
    hidden = int(need(config, "hidden_size"))
    add(f"{p}.input_layernorm.weight", hidden)
    add(f"{p}.post_attention_layernorm.weight", hidden)


def hf_ends(config: Mapping[str, Any], out: list[HfTensor], add: Add) -> list[HfTensor]:
    """Embeddings first, final norm and (untied) lm_head last."""
    vocab, hidden = int(need(config, "vocab_size")), int(need(config, "hidden_size"))
    body = list(out)
    out.clear()
    add("model.embed_tokens.weight", vocab, hidden)
    out.extend(body)
    add("model.norm.weight", hidden)
    if not tied(config):
        add("lm_head.weight", vocab, hidden)
    return out


def hf_tensors(family: str, config: Mapping[str, Any], dtype: str) -> list[HfTensor]:
    out, add = hf_builder(config, dtype)
    inter = int(need(config, "intermediate_size"))
    for i in range(int(need(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        hf_attention(family, config, p, add)
        hf_mlp(config, f"{p}.mlp", inter, add)
        hf_layer_norms(config, p, add)
    return hf_ends(config, out, add)


# --------------------------------------------------------------------------- engine
def kv_rows(ctx: Ctx, nkv: int, hd: int) -> tuple[int, int]:
    """This rank's rows of k_proj/v_proj (QKVParallelLinear's KV-head replication)."""
    tp, r = ctx.tp, ctx.rank
    if tp >= nkv:
        if tp % nkv:
            raise PlanError(f"tp {tp} is not a multiple of num_key_value_heads {nkv}")
        head = r // (tp // nkv)
        return head * hd, (head + 1) * hd
    lo, hi = split(nkv, tp, r, "num_key_value_heads")
    return lo * hd, hi * hd


def attention(ctx: Ctx, p: str) -> None:
    cfg, family = ctx.cfg, ctx.family
    nh = int(need(cfg, "num_attention_heads"))
    nkv = optional(cfg, "num_key_value_heads", nh)
    hd = head_dim(cfg)
    a = f"{p}.self_attn"
    qlo, qhi = split(nh, ctx.tp, ctx.rank, "num_attention_heads")
    qlo, qhi = qlo * hd, qhi * hd
    klo, khi = kv_rows(ctx, nkv, hd)
    ctx.linear(
        f"{a}.qkv_proj.weight",
        [
            ctx.rows(f"{a}.q_proj.weight", qlo, qhi),
            ctx.rows(f"{a}.k_proj.weight", klo, khi),
            ctx.rows(f"{a}.v_proj.weight", klo, khi),
        ],
    )
    if has_qkv_bias(family, cfg):
        ctx.vector(
            f"{a}.qkv_proj.bias",
            [
                ctx.rows(f"{a}.q_proj.bias", qlo, qhi),
                ctx.rows(f"{a}.k_proj.bias", klo, khi),
                ctx.rows(f"{a}.v_proj.bias", klo, khi),
            ],
        )
    ctx.linear(f"{a}.o_proj.weight", [ctx.cols(f"{a}.o_proj.weight", qlo, qhi)])
    if has_o_bias(family, cfg):
        ctx.whole(f"{a}.o_proj.bias", f"{a}.o_proj.bias")
    if family in ("qwen3", "qwen3_moe"):
        ctx.whole(f"{a}.q_norm.weight", f"{a}.q_norm.weight")
        ctx.whole(f"{a}.k_norm.weight", f"{a}.k_norm.weight")


def mlp(ctx: Ctx, p: str, hf_p: str | None = None) -> None:
    """gate_up_proj = [gate; up] rows of this rank, down_proj its columns (TP over all tp)."""
    hf_p = hf_p or p
    inter = ctx.shape(f"{hf_p}.gate_proj.weight")[0]
    lo, hi = split(inter, ctx.tp, ctx.rank, f"{hf_p} intermediate size")
    ctx.linear(
        f"{p}.gate_up_proj.weight",
        [ctx.rows(f"{hf_p}.gate_proj.weight", lo, hi), ctx.rows(f"{hf_p}.up_proj.weight", lo, hi)],
    )
    ctx.linear(f"{p}.down_proj.weight", [ctx.cols(f"{hf_p}.down_proj.weight", lo, hi)])


def layer_norms(ctx: Ctx, p: str) -> None:
    for n in ("input_layernorm", "post_attention_layernorm"):
        ctx.whole(f"{p}.{n}.weight", f"{p}.{n}.weight")


def embed(ctx: Ctx) -> None:
    ctx.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")


def ends(ctx: Ctx) -> None:
    ctx.whole("model.norm.weight", "model.norm.weight")
    if not tied(ctx.cfg):
        ctx.vocab("lm_head.weight", "lm_head.weight")


def engine_tensors(ctx: Ctx) -> None:
    embed(ctx)
    for i in range(int(need(ctx.cfg, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        attention(ctx, p)
        mlp(ctx, f"{p}.mlp")
        layer_norms(ctx, p)
    ends(ctx)
