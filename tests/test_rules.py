"""Model-family rules: every SGLang engine tensor, planned from HF-named trainer tensors
(FSDP-2 shards or whole) and executed, equals the plain reference (tests/rulesref.py)
bitwise, for every family, TP/EP layout and dtype; errors name what is wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from weightwire.client.dtypes import TORCH
from weightwire.plan.planner import EngineRank, plan
from weightwire.plan.rules import engine_tensors, family_of, hf_tensors, resolve
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import Box, DestTensor

from .hfweights import random_hf
from .planlib import engine, execute, trainer
from .rulesref import CONFIGS, FP8Q, reference

ROOT = Path(__file__).resolve().parent.parent

# (config, tp, ep, dest_dtype)
CASES = [
    ("qwen3", 1, 1, ""),
    ("qwen3", 2, 1, ""),
    ("qwen3", 4, 1, ""),  # KV-head replication: 2 kv heads over 4 ranks
    ("qwen3-tied", 2, 1, ""),
    ("qwen2", 2, 1, ""),
    ("qwen2", 4, 1, ""),
    ("llama", 2, 1, ""),
    ("llama-bias", 4, 1, ""),
    ("qwen3-moe", 1, 1, ""),
    ("qwen3-moe", 2, 1, ""),
    ("qwen3-moe", 2, 2, ""),
    ("qwen3-moe", 4, 2, ""),
    ("qwen3-moe", 4, 4, ""),
    ("deepseek-v3", 2, 1, ""),
    ("deepseek-v3", 2, 2, ""),
    ("deepseek-v3", 4, 4, ""),
    ("kimi-k2", 2, 2, ""),
    ("kimi-k2", 4, 2, ""),
    ("deepseek-noqlora", 2, 1, ""),
    ("qwen3", 2, 1, "float32"),  # cast on the sender
    ("qwen3-fp8", 1, 1, "fp8"),
    ("qwen3-fp8", 2, 1, "fp8"),
    ("qwen3-fp8-kvrep", 4, 1, ""),
    ("qwen2-fp8", 2, 1, "fp8"),
    ("llama-fp8", 2, 1, "fp8"),
    ("qwen3-moe-fp8", 2, 1, "fp8"),
    ("qwen3-moe-fp8", 2, 2, "fp8"),
    ("deepseek-v3-fp8", 2, 1, ""),
    ("deepseek-v3-fp8", 2, 2, ""),
]


def fsdp_boxes(
    hf: dict[str, torch.Tensor], rank: int, world: int, tile: int = 1
) -> dict[str, Box | None]:
    """FSDP-2 dim-0 shards (torch.chunk sizes); rounded up to `tile` rows for FP8, whose
    blocks must each come whole from one trainer rank."""
    out: dict[str, Box | None] = {}
    for name, t in hf.items():
        n = t.shape[0]
        step = -(-n // world)
        step = -(-step // tile) * tile
        lo, hi = min(n, rank * step), min(n, rank * step + step)
        out[name] = Box.rows(tuple(t.shape), lo, hi)
    return out


def layout(cfg: dict[str, Any], tp: int, rank: int, ep: int, dest: str) -> EngineLayout:
    return EngineLayout(
        tp_size=tp,
        tp_rank=rank,
        ep_size=ep,
        ep_rank=rank // (tp // ep),
        model=cfg,  # type: ignore[arg-type]
        dest_dtype=dest,
    )


def engines(cfg: dict[str, Any], tp: int, ep: int, dest: str) -> list[EngineRank]:
    """Each rank declares its SGLang tensors (name, dtype, shape) and leaves the recipes to
    the rules, as an engine adapter registering named_parameters() does."""
    out = []
    for r in range(tp):
        lay = layout(cfg, tp, r, ep, dest)
        declared = [(t.name, t.dtype, t.shape, None) for t in engine_tensors(cfg, lay)]
        e = engine("E", r, declared)  # type: ignore[arg-type]
        out.append(EngineRank(e.node, e.rank, resolve(e.tensors, lay), e.regions))
    return out


def fp8_block(cfg: dict[str, Any], dest: str) -> int | None:
    return 128 if dest == "fp8" or "quantization_config" in cfg else None


@pytest.mark.parametrize("trainers", ["fsdp2", "full"])
@pytest.mark.parametrize(("name", "tp", "ep", "dest"), CASES)
def test_rules_bitwise_vs_reference(name: str, tp: int, ep: int, dest: str, trainers: str) -> None:
    cfg = CONFIGS[name]
    hf = random_hf(cfg)
    block = fp8_block(cfg, dest)
    if trainers == "fsdp2":
        ts = [trainer(f"T{r}", r, hf, fsdp_boxes(hf, r, 2, block or 1)) for r in range(2)]
    else:
        ts = [trainer("T0", 0, hf, dict.fromkeys(hf))]
    es = engines(cfg, tp, ep, dest)
    plans = plan("job", ts, es)  # raises if any HF tensor is unused or any byte uncovered
    regions = execute(plans, ts, es, hf)
    dtype = TORCH[dest] if dest in ("float32", "float16") else torch.bfloat16
    qcache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for e in es:
        ref = reference(cfg, hf, tp, e.rank, ep, block, dtype, qcache)
        assert sorted(ref) == sorted(d.name for d in e.tensors), (
            "rules and reference disagree on names"
        )
        for d in e.tensors:
            want = ref[d.name]
            assert (tuple(want.shape), want.dtype) == (d.shape, TORCH[d.dtype]), d.name
            got = regions[e.rank][d.offset : d.offset + d.nbytes]
            assert torch.equal(got, want.contiguous().view(torch.uint8).flatten()), (
                f"rank {e.rank}: {d.name} differs"
            )


# --------------------------------------------------------------------------- coverage
PUBLISHED = {  # data/models/README.md: parameters implied by each config
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "kimi-k2": 1_026_408_232_448,
}


def real(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hf_tensors_of_published_configs(name: str) -> None:
    hf = hf_tensors(real(name))
    assert sum(math.prod(t.shape) for t in hf) == PUBLISHED[name]
    assert len({t.name for t in hf}) == len(hf)


@pytest.mark.parametrize(
    ("name", "tp", "ep"),
    [("qwen3-8b", 8, 1), ("qwen3-30b-a3b", 4, 2), ("qwen3-235b-a22b", 8, 8), ("kimi-k2", 8, 8)],
)
def test_published_configs_every_source_used_once_per_group(name: str, tp: int, ep: int) -> None:
    """Each HF tensor feeds some rank of a full TP/EP group; bf16 and FP8 layouts build
    (Kimi-K2's own config is FP8 blocks; Qwen3 made FP8 by dest_dtype)."""
    cfg = real(name)
    hf = {t.name: t for t in hf_tensors(cfg)}
    used: set[str] = set()
    for r in range(tp):
        for t in engine_tensors(cfg, layout(cfg, tp, r, ep, "fp8")):
            used |= {p.source for p in t.pieces if p.sent}
            assert all(p.source in hf for p in t.pieces if p.sent)
    assert used == set(hf)


FAMILY = {
    "qwen3": "qwen3",
    "qwen3-tied": "qwen3",
    "qwen3-fp8": "qwen3",
    "qwen3-fp8-kvrep": "qwen3",
    "qwen2": "qwen2",
    "qwen2-fp8": "qwen2",
    "llama-fp8": "llama",
    "llama": "llama",
    "llama-bias": "llama",
    "qwen3-moe": "qwen3_moe",
    "qwen3-moe-fp8": "qwen3_moe",
    "deepseek-v3": "deepseek_v3",
    "deepseek-v3-fp8": "deepseek_v3",
    "deepseek-noqlora": "deepseek_v3",
    "kimi-k2": "deepseek_v3",
}


def test_family_of() -> None:
    assert {n: family_of(c) for n, c in CONFIGS.items()} == FAMILY
    assert family_of({"model_type": "kimi_k2"}) == "deepseek_v3"
    assert family_of({}, "qwen3-moe") == "qwen3_moe"


# --------------------------------------------------------------------------- errors
def declared(cfg: dict[str, Any], lay: EngineLayout) -> list[DestTensor]:
    e = engine("E", 0, [(t.name, t.dtype, t.shape, None) for t in engine_tensors(cfg, lay)])  # type: ignore[misc]
    return list(e.tensors)


def test_unmapped_source_names_are_a_plan_error() -> None:
    cfg = CONFIGS["qwen3"]
    hf = random_hf(cfg)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(16)
    hf["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    ts = [trainer("T0", 0, hf, dict.fromkeys(hf))]
    with pytest.raises(PlanError) as exc:
        plan("job", ts, engines(cfg, 2, 1, ""))
    assert "source tensors no destination uses" in exc.value.message
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in exc.value.message
    assert "model.layers.9.mlp.gate_proj.weight" in exc.value.message


def test_missing_source_is_a_plan_error() -> None:
    cfg = CONFIGS["qwen3"]
    hf = random_hf(cfg)
    del hf["model.layers.1.self_attn.k_proj.weight"]
    ts = [trainer("T0", 0, hf, dict.fromkeys(hf))]
    with pytest.raises(PlanError, match=r"qkv_proj\.weight needs source tensor .*k_proj"):
        plan("job", ts, engines(cfg, 2, 1, ""))


def test_unknown_destination_names_are_listed() -> None:
    cfg = CONFIGS["deepseek-v3-fp8"]
    lay = layout(cfg, 2, 0, 1, "")
    ds = declared(cfg, lay)
    extra = engine(
        "E",
        0,
        [
            ("model.layers.0.self_attn.attn_mqa.k_scale", "float32", (), None),
            ("model.layers.0.self_attn.w_kc", "bfloat16", (2, 64, 128), None),
            ("model.layers.0.mlp.no_such.weight", "bfloat16", (4, 4), None),
        ],  # type: ignore[list-item]
    ).tensors
    with pytest.raises(PlanError) as exc:
        resolve([*ds, *extra], lay)
    assert exc.value.code is ErrorCode.UNKNOWN_TENSOR
    for d in extra:
        assert d.name in exc.value.message
    assert "k_scale/v_scale" in exc.value.message and "derived from kv_b_proj" in exc.value.message


def test_resolve_checks_shape_and_dtype() -> None:
    cfg = CONFIGS["qwen3"]
    lay = layout(cfg, 2, 1, 1, "")
    ds = declared(cfg, lay)
    i = next(k for k, d in enumerate(ds) if d.name.endswith("0.self_attn.qkv_proj.weight"))
    bad = list(ds)
    bad[i] = DestTensor(name=ds[i].name, dtype="bfloat16", shape=(96, 128), region=1, offset=0)
    with pytest.raises(PlanError) as exc:
        resolve(bad, lay)
    assert exc.value.code is ErrorCode.SHAPE_MISMATCH
    msg = exc.value.message
    assert (
        "model.layers.0.self_attn.qkv_proj.weight: expected shape [192, 128], got [96, 128]" in msg
    )
    bad[i] = DestTensor(name=ds[i].name, dtype="float16", shape=(192, 128), region=1, offset=0)
    with pytest.raises(
        PlanError, match=r"qkv_proj.weight: expected dtype bfloat16, got float16"
    ) as e2:
        resolve(bad, lay)
    assert e2.value.code is ErrorCode.DTYPE_MISMATCH
    bad.append(DestTensor(name="nope", dtype="float16", shape=(1,), region=1, offset=0))
    with pytest.raises(PlanError) as e3:
        resolve(bad, lay)
    assert e3.value.code is ErrorCode.PLAN and "nope" in e3.value.message


def test_resolve_keeps_given_recipes_and_fills_the_rest() -> None:
    cfg = CONFIGS["qwen3-moe"]
    lay = layout(cfg, 4, 3, 2, "")
    want = {t.name: t.pieces for t in engine_tensors(cfg, lay)}
    ds = declared(cfg, lay)
    mine = DestTensor(name="custom", dtype="bfloat16", shape=(2,), region=1, offset=0, pieces=())
    out = resolve([*ds, mine], lay)
    assert out[-1] is mine
    assert {d.name: d.pieces for d in out[:-1]} == want
    assert resolve([mine], EngineLayout()) == (mine,)


def test_fused_shared_experts_are_named_in_the_error() -> None:
    cfg = CONFIGS["deepseek-v3"]
    lay = layout(cfg, 2, 0, 1, "")
    ds = [
        DestTensor(
            name=d.name, dtype=d.dtype, shape=(d.shape[0] + 1, *d.shape[1:]), region=1, offset=0
        )
        if d.name.endswith("experts.w13_weight")
        else d
        for d in declared(cfg, lay)
    ]
    with pytest.raises(PlanError, match="fused the shared expert"):
        resolve(ds, lay)


def test_fp8_slices_must_be_whole_blocks() -> None:
    cfg = CONFIGS["qwen3-fp8"]  # 4 kv heads of 64 over tp 4: 64-row slices of k_proj
    with pytest.raises(PlanError, match=r"k_proj.weight \[256, 256\] to be whole blocks") as exc:
        engine_tensors(cfg, layout(cfg, 4, 1, 1, "fp8"))
    assert exc.value.code is ErrorCode.SHAPE_MISMATCH


def test_fp8_needs_whole_tiles_from_one_trainer_rank() -> None:
    """Plain FSDP-2 halves of a 192-row tensor split a 128-row tile: the planner refuses
    (the trainer has to hold tile-aligned shards, or gather)."""
    cfg = CONFIGS["deepseek-v3-fp8"]
    hf = random_hf(cfg)
    ts = [trainer(f"T{r}", r, hf, fsdp_boxes(hf, r, 2)) for r in range(2)]
    with pytest.raises(PlanError, match="needs whole 128x128 tiles"):
        plan("job", ts, engines(cfg, 2, 1, ""))


def test_layout_errors() -> None:
    cfg = CONFIGS["qwen3-moe"]
    decl = declared(cfg, layout(cfg, 2, 0, 1, ""))
    with pytest.raises(PlanError, match="carries no model config"):
        resolve(decl, EngineLayout(tp_size=2))
    with pytest.raises(PlanError, match="family 'llama'"):
        engine_tensors(cfg, EngineLayout(family="llama", model=cfg))  # type: ignore[arg-type]
    assert engine_tensors(cfg, EngineLayout(family="qwen3_moe", model=cfg))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="ep_rank 0"):
        engine_tensors(cfg, EngineLayout(tp_size=4, tp_rank=3, ep_size=2, model=cfg))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="must divide"):
        engine_tensors(cfg, EngineLayout(tp_size=4, ep_size=3))
    with pytest.raises(PlanError, match="dest_dtype"):
        engine_tensors(cfg, EngineLayout(dest_dtype="int4"))
    with pytest.raises(PlanError, match="no rules for this model"):
        hf_tensors({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(PlanError, match="every Qwen3-MoE layer sparse"):
        hf_tensors(dict(cfg, mlp_only_layers=[0]))
    with pytest.raises(PlanError, match=r"num_attention_heads \(8\) is not divisible by 3"):
        engine_tensors(CONFIGS["qwen3"], EngineLayout(tp_size=3))


def test_llama_block_fp8_is_warned_about_at_plan_time() -> None:
    """SGLang 0.5.23's Llama loader drops block-FP8 scales: the rules say so for that
    family and layout only (the recipes themselves are right: the bitwise cases above)."""
    from weightwire.plan.rules import LLAMA_FP8_SCALES, caveats

    def lay(cfg: dict[str, Any], dest: str) -> EngineLayout:
        return EngineLayout(tp_size=2, tp_rank=0, dest_dtype=dest, model=cfg)  # type: ignore[arg-type]

    llama, fp8_config = CONFIGS["llama-fp8"], dict(CONFIGS["llama-fp8"], quantization_config=FP8Q)
    assert caveats(llama, lay(llama, "fp8")) == [LLAMA_FP8_SCALES]
    assert caveats(fp8_config, lay(fp8_config, "")) == [LLAMA_FP8_SCALES]  # as the config says
    assert "weight_scale_inv" in LLAMA_FP8_SCALES and "weight_scale" in LLAMA_FP8_SCALES
    for cfg, dest in (
        (llama, ""),
        (llama, "bfloat16"),
        (fp8_config, "bfloat16"),
        (CONFIGS["qwen3-fp8"], "fp8"),
        (CONFIGS["deepseek-v3-fp8"], ""),
    ):
        assert caveats(cfg, lay(cfg, dest)) == [], (cfg["model_type"], dest)
