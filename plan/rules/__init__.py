"""Model-family rules: which HF-named source tensors make each SGLang engine tensor.

The public API (other modules build on exactly these names):

- `hf_tensors(config, dtype)`: the checkpoint's tensors (what trainer ranks hold once
  gathered), with HF names.
- `engine_tensors(config, layout)`: every tensor an SGLang engine rank at `layout` holds
  (SGLang names), each with its recipe (pieces from HF tensors).
- `resolve(declared, layout)`: fills in the pieces of declared destination tensors that
  left them to the rules; raises PlanError listing every name it cannot map.
- `caveats(config, layout)`: what is known to go wrong on the engine side for this model
  and layout although the recipes are right; the coordinator and `weightwire plan` warn.

Families (`family_of`): Llama, Qwen2, Qwen3 (`dense.py`), Qwen3-MoE (`qwen3_moe.py`),
DeepSeek-V3 / Kimi-K2 (`deepseek.py`); experts in `moe.py`, boxes and FP8 in `common.py`.
Every layout fact follows SGLang 0.5.23 as scripts/SGLANG_NOTES.md records it, and
tests/sglang checks it against SGLang's own loaders.

dtypes: `hf_tensors(config, dtype)` is a `dtype` checkpoint (DeepSeek's
`e_score_correction_bias` is float32, as published). `EngineLayout.dest_dtype`: "" = what
the config says (its `torch_dtype`; FP8 blocks when it has an fp8 `quantization_config`,
like Kimi-K2's); "bfloat16"/"float16"/"float32" = that dtype, nothing quantized; "fp8" =
float8_e4m3fn linear weights with float32 `weight_scale_inv` 128x128 block scales (the
config's block size if it gives one), made by the sender from the HF tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import DestTensor, Piece


@dataclass(frozen=True)
class HfTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class EngineTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def hf_tensors(config: Mapping[str, Any], dtype: str = "bfloat16") -> list[HfTensor]:
    from . import common

    if dtype not in common.FLOAT_DTYPES:
        raise PlanError(f"checkpoint dtype {dtype!r} is not one of {common.FLOAT_DTYPES}")
    family = common.family_of(config)
    return list(_family(family).hf_tensors(family, config, dtype))


def engine_tensors(config: Mapping[str, Any], layout: EngineLayout) -> list[EngineTensor]:
    return list(
        _engine_tensors(
            _key(config),
            layout.tp_size,
            layout.tp_rank,
            layout.ep_size,
            layout.ep_rank,
            layout.dest_dtype,
            layout.family,
        )
    )


def resolve(declared: Sequence[DestTensor], layout: EngineLayout) -> tuple[DestTensor, ...]:
    if all(d.pieces is not None for d in declared):
        return tuple(declared)
    if not layout.model:
        names = [d.name for d in declared if d.pieces is None]
        raise PlanError(
            f"{len(names)} destination tensors leave their recipe to the rules, but the engine "
            f"layout carries no model config: {', '.join(names)}",
            code=ErrorCode.UNKNOWN_TENSOR,
        )
    known = {t.name: t for t in engine_tensors(layout.model, layout)}
    out: list[DestTensor] = []
    unknown: list[str] = []
    problems: list[tuple[ErrorCode, str]] = []
    for d in declared:
        if d.pieces is not None:
            out.append(d)
            continue
        t = known.get(d.name)
        if t is None:
            unknown.append(d.name)
            continue
        if d.dtype != t.dtype:
            problems.append(
                (ErrorCode.DTYPE_MISMATCH, f"{d.name}: expected dtype {t.dtype}, got {d.dtype}")
            )
        if tuple(d.shape) != t.shape:
            problems.append(
                (
                    ErrorCode.SHAPE_MISMATCH,
                    f"{d.name}: expected shape {list(t.shape)}, got {list(d.shape)}"
                    + _shape_hint(d, t, layout),
                )
            )
        out.append(msgspec.structs.replace(d, pieces=t.pieces))
    if unknown:
        problems.append(
            (
                ErrorCode.UNKNOWN_TENSOR,
                f"{len(unknown)} tensors no rule maps ({_where(layout)}): "
                + ", ".join(unknown)
                + _unknown_hint(unknown, layout),
            )
        )
    if problems:
        codes = {c for c, _ in problems}
        raise PlanError(
            "cannot resolve destination tensors:\n  " + "\n  ".join(m for _, m in problems),
            code=codes.pop() if len(codes) == 1 else ErrorCode.PLAN,
        )
    return tuple(out)


LLAMA_FP8_SCALES = (
    "Llama with block-FP8 weights: SGLang 0.5.23's LlamaForCausalLM.load_weights renames "
    "weight_scale_inv to weight_scale, which block-FP8 layers lack, so SGLang's own loader "
    "drops those scales. weightwire writes the right weight_scale_inv into the engine, "
    "but nothing of SGLang checks them: they are not compared with SGLang's load_weights "
    "(which leaves them unset), and a replica-mode trainer built with SGLang's loader "
    "would send unset scales"
)


def caveats(config: Mapping[str, Any], layout: EngineLayout) -> list[str]:
    """Known engine-side limits for this model and layout, to be warned about at plan time
    (SGLang 0.5.23; scripts/SGLANG_NOTES.md)."""
    from .common import fp8_block

    out = []
    if family_of(config, layout.family) == "llama":
        dest = layout.dest_dtype.removeprefix("torch.")
        if dest == "fp8" or (dest == "" and fp8_block(config) is not None):
            out.append(LLAMA_FP8_SCALES)
    return out


def family_of(config: Mapping[str, Any], hint: str = "") -> str:
    """The rules family: llama, qwen2, qwen3, qwen3_moe or deepseek_v3 (Kimi-K2 too)."""
    from .common import family_of as f

    return f(config, hint)


# --------------------------------------------------------------------------- internals
def _family(family: str) -> Any:
    if family == "qwen3_moe":
        from . import qwen3_moe

        return qwen3_moe
    if family == "deepseek_v3":
        from . import deepseek

        return deepseek
    from . import dense

    return dense


def _key(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


@lru_cache(maxsize=8)
def _hf_tensors(config_json: str, dtype: str) -> tuple[HfTensor, ...]:
    """One model's HF tensors, shared by the engine ranks the coordinator resolves."""
    return tuple(hf_tensors(json.loads(config_json), dtype))


@lru_cache(maxsize=64)
def _engine_tensors(
    config_json: str, tp: int, rank: int, ep: int, ep_rank: int, dest_dtype: str, family: str
) -> tuple[EngineTensor, ...]:
    from .common import checkpoint_dtype, make_ctx

    config = json.loads(config_json)
    layout = EngineLayout(
        family=family, tp_size=tp, tp_rank=rank, ep_size=ep, ep_rank=ep_rank, dest_dtype=dest_dtype
    )
    ctx = make_ctx(config, layout, _hf_tensors(config_json, checkpoint_dtype(config)))
    _family(ctx.family).engine_tensors(ctx)
    return tuple(ctx.out)


def _where(layout: EngineLayout) -> str:
    m: Mapping[str, Any] = layout.model
    archs = m.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else m.get("model_type", "?")
    return (
        f"{arch}, tp rank {layout.tp_rank}/{layout.tp_size}, ep {layout.ep_size}, "
        f"dest_dtype {layout.dest_dtype or 'as the config says'}"
    )


def _shape_hint(d: DestTensor, t: EngineTensor, layout: EngineLayout) -> str:
    experts = d.name.endswith((".experts.w13_weight", ".experts.w2_weight"))
    if experts and d.shape and d.shape[0] == t.shape[0] + 1:
        return (
            " (one expert more than the routed experts of this rank: the engine fused "
            "the shared expert into the routed ones, which these rules do not cover)"
        )
    if d.name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return " (vocab rows per rank after SGLang's padding to 64, or 64*tp)"
    return ""


def _unknown_hint(names: list[str], layout: EngineLayout) -> str:
    hints = []
    if any(n.endswith((".k_scale", ".v_scale")) for n in names):
        hints.append(
            "k_scale/v_scale are attention scales the engine sets (1.0), not from the "
            "checkpoint: do not declare them"
        )
    if "lm_head.weight" in names and layout.model.get("tie_word_embeddings"):
        hints.append("tied embeddings: lm_head is model.embed_tokens, declare only that")
    if any(n.endswith((".w_kc", ".w_vc", ".w_scale")) for n in names):
        hints.append("MLA w_kc/w_vc/w_scale are derived from kv_b_proj by the engine")
    if any("cos_sin_cache" in n for n in names):
        hints.append("rotary cos_sin_cache is computed by the engine")
    return (" (" + "; ".join(hints) + ")") if hints else ""
