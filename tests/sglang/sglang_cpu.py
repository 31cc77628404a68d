"""Build SGLang's real model classes on CPU at a chosen TP/EP rank, without a GPU
and without torch.distributed, and load HF-named tensors through the model's own
``load_weights``.

The machinery lives in ``weightwire.adapters.sglang.cpu`` (replica mode builds its CPU
replicas with it); this module re-exports it for the tests, forces the
``sgl_kernel`` and ``torchvision`` stand-ins (whatever is installed), and keeps the
hand-written HF checkpoint names used to check the layouts.

Importing this module (before anything imports sglang) sets
``SGLANG_USE_CPU_ENGINE=1`` and installs stand-in modules for ``sgl_kernel``
(no CPU wheel) and ``torchvision`` (PyPI's build does not match torch 2.13+cpu).
Every attribute of a stand-in is a callable that raises when called: model
construction and ``load_weights`` for the supported families never call them.

Usage (inside ``.venv-sglang``, see scripts/sglang-env.sh)::

    from . import sglang_cpu               # in tests/sglang/, first
    model = sglang_cpu.build_model(hf_config, tp_size=2, tp_rank=1, ep_size=1)
    sglang_cpu.load_hf_weights(model, named_tensors)
    for name, p in sglang_cpu.engine_tensors(model): ...

Only stdlib, torch, sglang and weightwire are used. See scripts/SGLANG_NOTES.md.
"""

from __future__ import annotations

import torch

from weightwire.adapters.sglang.cpu import (  # noqa: F401  (re-exported)
    STANDIN_ROOTS,
    FakeGroup,
    build_model,
    config_dir,
    engine_tensors,
    extra_tensor_attrs,
    install_standins,
    load_hf_weights,
    publish_topology,
    republish,
)

install_standins(STANDIN_ROOTS)


# --------------------------------------------------------------------------- HF names
def hf_checkpoint_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of an HF *checkpoint* (safetensors names, per-expert
    tensors) for the families this module knows: Llama, Qwen2, Qwen3,
    Qwen3-MoE, DeepSeek-V3 / Kimi-K2. Unquantized."""
    arch = cfg["architectures"][0]
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (V, H))]

    def mlp(p: str, inter: int) -> None:
        out.extend(
            [
                (f"{p}.gate_proj.weight", (inter, H)),
                (f"{p}.up_proj.weight", (inter, H)),
                (f"{p}.down_proj.weight", (H, inter)),
            ]
        )

    for i in range(L):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (H,)),
            (f"{p}.post_attention_layernorm.weight", (H,)),
        ]
        if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
            nh = cfg["num_attention_heads"]
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            kvl, ql = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
            a = f"{p}.self_attn"
            if ql:
                out += [
                    (f"{a}.q_a_proj.weight", (ql, H)),
                    (f"{a}.q_a_layernorm.weight", (ql,)),
                    (f"{a}.q_b_proj.weight", (nh * (nope + rope), ql)),
                ]
            else:
                out.append((f"{a}.q_proj.weight", (nh * (nope + rope), H)))
            out += [
                (f"{a}.kv_a_proj_with_mqa.weight", (kvl + rope, H)),
                (f"{a}.kv_a_layernorm.weight", (kvl,)),
                (f"{a}.kv_b_proj.weight", (nh * (nope + vd), kvl)),
                (f"{a}.o_proj.weight", (H, nh * vd)),
            ]
            if i < cfg.get("first_k_dense_replace", 0):
                mlp(f"{p}.mlp", cfg["intermediate_size"])
            else:
                E, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
                out.append((f"{p}.mlp.gate.weight", (E, H)))
                if cfg.get("topk_method") == "noaux_tc":
                    out.append((f"{p}.mlp.gate.e_score_correction_bias", (E,)))
                for e in range(E):
                    mlp(f"{p}.mlp.experts.{e}", mi)
                if cfg.get("n_shared_experts"):
                    mlp(f"{p}.mlp.shared_experts", mi * cfg["n_shared_experts"])
            continue
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or H // nh
        a = f"{p}.self_attn"
        out += [
            (f"{a}.q_proj.weight", (nh * hd, H)),
            (f"{a}.k_proj.weight", (nkv * hd, H)),
            (f"{a}.v_proj.weight", (nkv * hd, H)),
            (f"{a}.o_proj.weight", (H, nh * hd)),
        ]
        if arch == "Qwen2ForCausalLM" or cfg.get("attention_bias"):
            out += [
                (f"{a}.q_proj.bias", (nh * hd,)),
                (f"{a}.k_proj.bias", (nkv * hd,)),
                (f"{a}.v_proj.bias", (nkv * hd,)),
            ]
        if arch.startswith("Qwen3"):
            out += [(f"{a}.q_norm.weight", (hd,)), (f"{a}.k_norm.weight", (hd,))]
        if arch == "Qwen3MoeForCausalLM" and i not in cfg.get("mlp_only_layers", []):
            E, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            out.append((f"{p}.mlp.gate.weight", (E, H)))
            for e in range(E):
                mlp(f"{p}.mlp.experts.{e}", mi)
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
    out.append(("model.norm.weight", (H,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, H)))
    return out


def random_hf_weights(
    cfg: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Deterministic random full (unsharded) HF-named tensors for ``cfg``."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in hf_checkpoint_shapes(cfg)}
