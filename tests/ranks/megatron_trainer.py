"""One rank of a real Megatron-core trainer (megatron.core's GPTModel, parallel_state on
gloo, CPU) for tests/test_megatron.py. Commands on stdin, one JSON object a line:

- {"cmd": "setup", "job": ..., "hf": {HF config}, "tp": n, "pp": n, "ep": n, "etp": n,
  "divisible_by": n, "delta": "off" | "auto" | "on"}: (re)initialize Megatron's
  parallel groups, build this stage's GPTModel from the HF config (vocabulary padded as
  Megatron-LM pads it), give every parameter values of its own (replicas alike),
  register it with `Trainer.register_megatron`, prepare;
- {"cmd": "publish", "version": v, "move": bool, "sparse": bool}: an optimizer-like
  in-place step (with `move`, on new storage for every parameter; with `sparse`, of
  about 2 % of each parameter's elements, as RL steps change bf16 weights), then this
  rank's own parameters as they are (Megatron names, with its TP/PP/EP coordinates) saved to
  `<out>/<job>-v<v>-r<rank>.pt` for the test's own Megatron->HF conversion, then
  `publish(v)`;
- {"cmd": "close"}.

Events on stdout, one JSON object a line.
"""

from __future__ import annotations

import argparse
import os
import warnings
import zlib
from typing import Any

import torch

from tests.ranks.rankloop import Ranked, say, serve, start


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's `_vocab_size_with_padding`."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def build(hf: dict[str, Any], tp: int, pp: int, ep: int, etp: int, divisible_by: int) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    experts = hf.get("num_experts") or hf.get("n_routed_experts")
    mla = "kv_lora_rank" in hf
    qk_norm = hf["model_type"].startswith("qwen3") or mla
    common: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        gated_linear_unit=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        qk_layernorm=qk_norm,
        num_moe_experts=experts,
        moe_ffn_hidden_size=hf.get("moe_intermediate_size"),
        moe_router_topk=hf.get("num_experts_per_tok", 2),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
    )
    if mla:  # DeepSeek-V3: MLA, a dense first layer, a shared expert, an expert bias
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        dense = hf["first_k_dense_replace"]
        cfg: Any = MLATransformerConfig(
            **common,
            q_lora_rank=hf["q_lora_rank"],
            kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_type="rope",
            moe_layer_freq=[0] * dense + [1] * (hf["num_hidden_layers"] - dense),
            moe_shared_expert_intermediate_size=hf["moe_intermediate_size"]
            * hf["n_shared_experts"],
            moe_router_enable_expert_bias=True,
            moe_router_score_function="sigmoid",
        )
        spec: Any = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm"
        )
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = NoCoreAttention
    else:
        cfg = TransformerConfig(
            **common,
            num_query_groups=hf["num_key_value_heads"],
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            add_qkv_bias=hf["model_type"] == "qwen2",
        )
        spec = get_gpt_layer_local_spec(
            num_experts=experts, qk_layernorm=qk_norm, normalization="RMSNorm"
        )
    torch.manual_seed(0)
    # Tied embeddings over pipeline stages: Megatron syncs the last stage's copy through
    # `weight.data.cuda()` then an all-reduce; on CPU (gloo) the tensor stays where it is.
    # MLA's rotary embedding asks for the current CUDA device: on CPU, the CPU.
    cuda, torch.Tensor.cuda = torch.Tensor.cuda, lambda t, *a, **k: t  # type: ignore[method-assign]
    device, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"  # type: ignore[assignment]
    try:
        return make(cfg, spec, hf, tp, divisible_by)
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]
        torch.cuda.current_device = device


def make(cfg: Any, spec: Any, hf: dict[str, Any], tp: int, divisible_by: int) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        cfg,
        spec,
        vocab_size=padded_vocab(hf["vocab_size"], divisible_by, tp),
        max_sequence_length=hf["max_position_embeddings"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
        position_embedding_type="rope",
    )


class NoCoreAttention(torch.nn.Module):
    """Megatron-core 0.16's MLA builds its core attention with arguments only Transformer
    Engine's accepts; the weights never go through it, and it has no parameters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


def no_transformer_engine() -> None:
    """MLA checks `isinstance(linear_proj, TELinear)`, no class without Transformer Engine
    (megatron-core 0.16 leaves a stand-in object there)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.TELinear = type("NoTELinear", (), {})


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """Parameters, and the router's expert bias (a buffer in Megatron, a weight in HF)."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    return out


def coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
    }


def fill(model: Any) -> None:
    """Values of each parameter's own: seeded by its name and the coordinates that tell its
    shards apart, so replicas (other DP, EP or TP ranks holding the same) agree."""
    c = coordinates()
    with torch.no_grad():
        for name, p in tensors(model).items():
            if ".experts." in name:
                key = f"{name}|pp{c['pp']}|ep{c['ep']}|etp{c['etp']}"
            elif getattr(p, "tensor_model_parallel", False):
                key = f"{name}|pp{c['pp']}|tp{c['tp']}"
            else:
                key = f"{name}|pp{c['pp']}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            p.copy_(torch.randn(p.shape, generator=g))  # bfloat16 (float32 expert bias)


def step(model: Any, version: int, move: bool, sparse: bool = False) -> None:
    """An optimizer-like update in place; with `move`, every parameter first gets new
    storage (what offloading the model to the CPU and back between rollouts does); with
    `sparse`, of about 2 % of its elements (the same ones on replicas)."""
    with torch.no_grad():
        for name, p in tensors(model).items():
            if move:
                p.data = p.data.clone()
            if sparse:
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}|{version}".encode()))
                mask = torch.rand(p.shape, generator=g) < 0.02
                p[mask] = p[mask] * 0.75 + version / 8
            else:
                p.mul_(0.75).add_(version / 8)


def main() -> None:
    warnings.filterwarnings("ignore")
    a = start(argparse.ArgumentParser())
    import megatron.core  # noqa: F401  (imported once, before the first setup)

    no_transformer_engine()

    model: Any = None
    ranked = Ranked(a)
    job = ""

    def setup(msg: dict[str, Any]) -> None:
        nonlocal model, job
        ranked.close()
        job = msg["job"]
        hf = msg["hf"]
        model = build(hf, msg["tp"], msg["pp"], msg["ep"], msg["etp"], msg["divisible_by"])
        fill(model)
        tr = ranked.trainer(job, msg.get("delta", "off"))
        boxes = tr.register_megatron(model, hf)
        tr.prepare()
        say(event="ready", rank=a.rank, job=job, boxes=boxes, **coordinates())

    def publish(msg: dict[str, Any]) -> None:
        assert model is not None
        v = msg["version"]
        if msg.get("move") and ranked.tr is not None:  # as before an offload: hold nothing
            ranked.tr.release_parameters()
        step(model, v, bool(msg.get("move")), bool(msg.get("sparse")))
        own = {n: p.detach().clone() for n, p in tensors(model).items()}
        torch.save(
            {"params": own, **coordinates()},
            os.path.join(a.out, f"{job}-v{v}-r{a.rank}.pt"),
        )
        ranked.publish(v)

    serve(ranked, {"setup": setup, "publish": publish})


if __name__ == "__main__":
    main()
