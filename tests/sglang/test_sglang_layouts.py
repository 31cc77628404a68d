"""weightwire's recipes against SGLang itself: SGLang 0.5.23's real model classes, built on
CPU as every TP (and EP) rank, load random HF-named weights through their own
`load_weights`; every parameter an engine adapter would register
(`model.named_parameters()`) is declared to `resolve` by name, dtype and shape only, and
the recipes it returns, executed on the full HF tensors with the sender's own `pack`,
must give the parameter's bytes exactly. The plain reference (tests/rulesref.py) is held
to the same bytes.

FP8: SGLang loads an FP8 block checkpoint made by weightwire's quantizer from the same
HF tensors (whole tensors quantized, as a published FP8 checkpoint is); weightwire's
recipes quantize each rank's slice on the sender. Equal bytes mean every slice is whole
blocks and the scales land where SGLang's loaders put them.

Runs only in `.venv-sglang` (`make test-sglang`); skipped anywhere sglang is missing.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not importable here: `make test-sglang` runs tests/sglang in .venv-sglang",
        allow_module_level=True,
    )

warnings.filterwarnings("ignore")

from . import sglang_cpu  # noqa: E402  (first: SGLANG_USE_CPU_ENGINE and the stand-in modules)

# isort: split
import torch  # noqa: E402

from weightwire.client.dtypes import name_of  # noqa: E402
from weightwire.client.fp8 import quantize_blocks  # noqa: E402
from weightwire.client.pack import pack  # noqa: E402
from weightwire.plan.rules import hf_tensors, resolve  # noqa: E402
from weightwire.protocol.errors import PlanError  # noqa: E402
from weightwire.protocol.local import EngineLayout  # noqa: E402
from weightwire.protocol.plan import PackOp  # noqa: E402
from weightwire.protocol.tensors import DestTensor, Piece, nbytes, piece_nbytes  # noqa: E402

from ..hfweights import random_hf  # noqa: E402
from ..rulesref import CONFIGS, FP8Q, reference  # noqa: E402

BLOCK = 128
pytestmark = pytest.mark.filterwarnings("ignore")  # SGLang's import-time chatter

# (config, tp, ep, fp8)
CASES = [
    ("qwen3", 1, 1, False),
    ("qwen3", 2, 1, False),
    ("qwen3", 4, 1, False),  # 2 kv heads over 4 ranks: replicated
    ("qwen3-tied", 2, 1, False),
    ("qwen2", 2, 1, False),
    ("qwen2", 4, 1, False),
    ("llama", 1, 1, False),
    ("llama", 2, 1, False),
    ("llama", 4, 1, False),
    ("llama-bias", 2, 1, False),
    ("qwen3-moe", 1, 1, False),
    ("qwen3-moe", 2, 1, False),
    ("qwen3-moe", 2, 2, False),
    ("qwen3-moe", 4, 1, False),
    ("qwen3-moe", 4, 2, False),
    ("qwen3-moe", 4, 4, False),
    ("deepseek-v3", 1, 1, False),
    ("deepseek-v3", 2, 1, False),
    ("deepseek-v3", 2, 2, False),
    ("deepseek-v3", 4, 2, False),
    ("deepseek-v3", 4, 4, False),
    ("kimi-k2", 2, 2, False),
    ("kimi-k2", 4, 2, False),
    ("deepseek-noqlora", 2, 1, False),
    ("qwen3-fp8", 1, 1, True),
    ("qwen3-fp8", 2, 1, True),
    ("qwen3-fp8-kvrep", 4, 1, True),
    ("qwen2-fp8", 2, 1, True),
    ("llama-fp8", 2, 1, True),
    ("qwen3-moe-fp8", 1, 1, True),
    ("qwen3-moe-fp8", 2, 1, True),
    ("qwen3-moe-fp8", 2, 2, True),
    ("deepseek-v3-fp8", 1, 1, True),
    ("deepseek-v3-fp8", 2, 1, True),
    ("deepseek-v3-fp8", 2, 2, True),
]


def config(name: str, fp8: bool) -> dict[str, Any]:
    cfg = dict(CONFIGS[name])
    if fp8:
        cfg["quantization_config"] = FP8Q  # what makes SGLang build FP8 block layers
    return cfg


def fp8_checkpoint(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 block checkpoint of `hf`, as published FP8 checkpoints are laid out: every
    2-D linear weight except embeddings, lm_head and the router becomes float8_e4m3fn
    codes plus a float32 `weight_scale_inv` (scripts/SGLANG_NOTES.md)."""
    out = {}
    for n, t in hf.items():
        keep = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
        if t.dim() == 2 and not any(k in n for k in keep):
            out[n], out[n + "_scale_inv"] = quantize_blocks(t, BLOCK)
        else:
            out[n] = t
    return out


def run_recipe(d: DestTensor, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The destination's bytes: each piece packed by the sender's own code, in place."""
    out = torch.zeros(nbytes(d.dtype, d.shape), dtype=torch.uint8)
    assert d.pieces is not None
    for p in d.pieces:
        if not p.sent:
            continue  # Zeros: the engine keeps those bytes at zero
        n = piece_nbytes(name_of(hf[p.source].dtype), p)
        op = PackOp(source=p.source, box=p.box, transform=p.transform, staging_offset=0, nbytes=n)
        pack(op, hf[p.source], out[p.dst_offset : p.dst_offset + n])
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def not_from_checkpoint(name: str) -> bool:
    """FP8 attention's `attn*.k_scale`/`v_scale` (Llama, Qwen2, DeepSeek MLA): KV-cache
    scales SGLang sets itself when the checkpoint has none, as an FP8 block one does not."""
    return name.endswith((".k_scale", ".v_scale"))


def drops_block_scales(cfg: dict[str, Any], name: str) -> bool:
    """SGLang 0.5.23's LlamaForCausalLM.load_weights renames `.weight_scale_inv` to
    `.weight_scale` (per-tensor FP8), which a block-FP8 layer does not have: it logs
    "Parameter ... not found" and never loads a Llama block-FP8 checkpoint's scales."""
    return cfg["model_type"] == "llama" and name.endswith(".weight_scale_inv")


@pytest.mark.parametrize(("name", "tp", "ep", "fp8"), CASES)
def test_recipes_match_sglang_load_weights(name: str, tp: int, ep: int, fp8: bool) -> None:
    cfg = config(name, fp8)
    hf = random_hf(cfg)
    ckpt = fp8_checkpoint(hf) if fp8 else hf
    used: set[str] = set()
    qcache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for rank in range(tp):
        model = sglang_cpu.build_model(cfg, tp_size=tp, tp_rank=rank, ep_size=ep)
        sglang_cpu.load_hf_weights(model, ckpt.items())
        params = {n: p.data for n, p in model.named_parameters()}  # what an adapter registers
        skipped = sorted(n for n in params if not_from_checkpoint(n))
        assert not skipped or fp8, skipped
        lay = EngineLayout(
            tp_size=tp,
            tp_rank=rank,
            ep_size=ep,
            ep_rank=rank // (tp // ep),
            model=cfg,  # type: ignore[arg-type]
            dest_dtype="fp8" if fp8 else "",
        )
        declared = [
            DestTensor(name=n, dtype=name_of(t.dtype), shape=tuple(t.shape), region=0, offset=0)
            for n, t in params.items()
            if n not in skipped
        ]
        ref = reference(cfg, hf, tp, rank, ep, BLOCK if fp8 else None, qcache=qcache)
        assert sorted(ref) == sorted(d.name for d in declared)
        bad = []
        for d in resolve(declared, lay):  # PlanError if a name, dtype or shape disagrees
            if drops_block_scales(cfg, d.name):
                # never loaded by SGLang: still its initial value; checked by test_rules only
                assert bool((params[d.name] == -torch.finfo(torch.float32).max).all())
                continue
            want = raw(params[d.name])
            if not torch.equal(run_recipe(d, hf), want):
                bad.append(f"{d.name} (recipe)")
            if not torch.equal(raw(ref[d.name]), want):
                bad.append(f"{d.name} (reference)")
            used |= {p.source for p in d.pieces or () if p.sent}
        assert not bad, f"rank {rank}/{tp} ep {ep}: differ from SGLang: {bad}"
    assert used == set(hf), f"HF tensors no rank uses: {sorted(set(hf) - used)}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_tensors_match_the_checkpoint_names_sglang_loads(name: str) -> None:
    """hf_tensors against sglang_cpu.py's checkpoint list (written by hand)."""
    cfg = CONFIGS[name]
    ours = {t.name: t.shape for t in hf_tensors(cfg)}
    theirs = dict(sglang_cpu.hf_checkpoint_shapes(cfg))
    if cfg.get("attention_bias") and cfg["model_type"] != "qwen2":
        # sglang_cpu's list leaves out o_proj.bias, which SGLang's Llama/Qwen3 build and
        # load with attention_bias (checked bitwise by the llama-bias case above).
        for i in range(cfg["num_hidden_layers"]):
            theirs[f"model.layers.{i}.self_attn.o_proj.bias"] = (cfg["hidden_size"],)
    assert ours == theirs


def test_fused_shared_experts_are_refused_by_name() -> None:
    """A CUDA DeepSeek-V3 engine (256 experts, 1 shared, ep 1) fuses the shared expert
    into slot E of the routed experts; the rules do not express that layout, and resolve
    says so instead of writing a wrong one."""
    cfg = CONFIGS["deepseek-v3"]
    model = sglang_cpu.build_model(
        cfg, tp_size=2, tp_rank=0, ep_size=1, enforce_shared_experts_fusion=True
    )
    params = dict(model.named_parameters())
    assert not any(".shared_experts." in n for n in params)
    declared = [
        DestTensor(name=n, dtype=name_of(p.dtype), shape=tuple(p.shape), region=0, offset=0)
        for n, p in params.items()
    ]
    lay = EngineLayout(tp_size=2, tp_rank=0, model=cfg)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="fused the shared expert"):
        resolve(declared, lay)


def test_zero_padding_is_what_sglang_holds() -> None:
    """The vocab padding rows SGLang fills with zeros are Zeros pieces, never sent."""
    cfg = CONFIGS["qwen3"]
    model = sglang_cpu.build_model(cfg, tp_size=4, tp_rank=3, ep_size=1)
    sglang_cpu.load_hf_weights(model, random_hf(cfg).items())
    emb = dict(model.named_parameters())["model.embed_tokens.weight"].data
    lay = EngineLayout(tp_size=4, tp_rank=3, model=cfg)  # type: ignore[arg-type]
    d = DestTensor(
        name="model.embed_tokens.weight",
        dtype="bfloat16",
        shape=tuple(emb.shape),
        region=0,
        offset=0,
    )
    (r,) = resolve([d], lay)
    assert r.pieces is not None
    zeros = [p for p in r.pieces if not p.sent]
    assert [p.box.sizes for p in zeros] == [(1024 // 4 - (1000 - 768), 128)]
    assert not emb[1000 - 768 :].any()
    assert all(isinstance(p, Piece) for p in r.pieces)
