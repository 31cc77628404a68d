"""Megatron-core trainers registered as they are (`Trainer.register_megatron`), through
real daemons into SGLang-layout engines (recipes from the model-family rules), checked
bitwise against the test's own Megatron->HF conversion of every rank's parameters.

Four real torch.distributed ranks (gloo, CPU) build megatron-core's own GPTModel (the
local, non-Transformer-Engine layer spec) under Megatron's own parallel_state, one layout
per job, the same four processes for all:

- Qwen3 dense, TP 2 x PP 2: two query groups per TP rank (interleaved QKV held as views
  stepping over the groups), fused [gate; up] fc1, row-parallel linears, pipeline layer
  offsets, vocabulary 1000 padded to 1024 (make_vocab_size_divisible_by 128 x TP 2: the
  last rank holds 24 pad rows, never sent), untied output layer; into one TP-1 engine
  rank (every tensor assembled from several trainer ranks) and TP-4 engines.
- Qwen3-MoE, TP 2 x EP 2 x expert TP 2: `local_experts.N` of each EP rank, each cut over
  expert TP like a dense MLP; into TP-2 / EP-2 engines.
- DeepSeek-V3, TP 2 x EP 2: MLA (`linear_q_down_proj` ... `linear_kv_up_proj`, q/kv
  layernorms), a dense first layer, a shared expert, the router's expert bias (a float32
  buffer); into TP-2 / EP-2 engines. Megatron-core 0.16 cannot build MLA without
  Transformer Engine as it is; the rank script stands in for the three parameter-free
  parts that need it (see tests/ranks/megatron_trainer.py).
- Kimi-K2 (DeepSeek-V3's layout), PP 2 x EP 2 (TP 1, two replicas of the attention):
  the dense layer on one stage, the MoE layer on the other; into TP-4 / EP-2 engines.
- Qwen2 (QKV bias), TP 1 x PP 2, tied embeddings (the last stage's output-layer copy is
  left out), two replicas; into TP-2 engines.

The conversion here (`to_hf`) is written from Megatron's documented layouts, with torch.cat
of whole shards, and shares no code with weightwire.client.megatron."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from weightwire.client import Engine
from weightwire.client.buckets import row_parts, slice_box
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import hf_tensors
from weightwire.protocol.tensors import Box, Cast, Copy, Fp8BlockQuant, Fp8BlockScale

from .multirank import Rank, check_engines, engine_group, out_dir, rank_procs
from .rulesref import CONFIGS

pytestmark = pytest.mark.megatron
HERE = Path(__file__).parent
WORLD = 4
DIVISIBLE_BY = 128

JOBS: dict[str, dict[str, Any]] = {
    "dense": dict(
        hf=dict(CONFIGS["qwen3"], num_key_value_heads=4),  # 2 query groups per TP rank
        tp=2, pp=2, ep=1, etp=1, engines=[(1, 1), (4, 1)],
    ),
    "moe": dict(hf=CONFIGS["qwen3-moe"], tp=2, pp=1, ep=2, etp=2, engines=[(2, 2)]),
    "deepseek": dict(hf=CONFIGS["deepseek-v3"], tp=2, pp=1, ep=2, etp=1, engines=[(2, 2)]),
    "kimi": dict(hf=CONFIGS["kimi-k2"], tp=1, pp=2, ep=2, etp=1, engines=[(4, 2)]),
    "tied": dict(
        hf=dict(CONFIGS["qwen2"], tie_word_embeddings=True),
        tp=1, pp=2, ep=1, etp=1, engines=[(2, 1)],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def ranks(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    out = tmp_path_factory.mktemp("megatron")
    with rank_procs("megatron_trainer.py", cluster, out, WORLD, started_s=180) as procs:
        yield procs


# --- the test's own Megatron -> HF conversion -------------------------------------------


def _cat(shards: dict[int, torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat([shards[i] for i in sorted(shards)], dim=dim)


def _fc1(shards: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each TP rank's fc1 is [its gate rows; its up rows]."""
    halves = [shards[r].chunk(2, dim=0) for r in sorted(shards)]
    return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])


def to_hf(
    hf: dict[str, Any], tp: int, pp: int, ep: int, etp: int, files: list[Path]
) -> dict[str, Any]:
    """Megatron-LM's documented layouts, undone with whole shards: TP shards concatenated
    (column-parallel on dim 0, row-parallel on dim 1); linear_qkv as [q heads; k; v] per
    query group; linear_fc1 as each TP rank's [gate; up]; layers split evenly over PP
    stages; experts split evenly over EP ranks; padded vocabulary rows dropped."""
    by: dict[tuple[str, int, int, int], torch.Tensor] = {}  # (name, pp, tp|ep, etp)
    for f in files:
        s = torch.load(f)
        for name, t in s["params"].items():
            key = (name, s["pp"], s["ep"], s["etp"]) if ".experts." in name else None
            key = key or (name, s["pp"], s["tp"], 0)
            if key in by:  # a replica: the same values
                assert torch.equal(by[key], t), f"replicas of {key} differ"
            by[key] = t
    layers_per_stage = hf["num_hidden_layers"] // pp
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or 0
    out: dict[str, torch.Tensor] = {}

    def tp_shards(name: str, stage: int) -> dict[int, torch.Tensor]:
        return {r: by[(name, stage, r, 0)] for r in range(tp)}

    for stage in range(pp):
        if stage == 0:
            emb = _cat(tp_shards("embedding.word_embeddings.weight", 0), 0)
            out["model.embed_tokens.weight"] = emb[: hf["vocab_size"]]
        if stage == pp - 1:
            out["model.norm.weight"] = by[("decoder.final_layernorm.weight", stage, 0, 0)]
            if not hf.get("tie_word_embeddings"):
                lm = _cat(tp_shards("output_layer.weight", stage), 0)
                out["lm_head.weight"] = lm[: hf["vocab_size"]]
        for j in range(layers_per_stage):
            src, dst = f"decoder.layers.{j}.", f"model.layers.{stage * layers_per_stage + j}."
            out[dst + "input_layernorm.weight"] = by[(src + "input_layernorm.weight", stage, 0, 0)]
            out[dst + "post_attention_layernorm.weight"] = by[
                (src + "pre_mlp_layernorm.weight", stage, 0, 0)
            ]
            if "kv_lora_rank" in hf:  # MLA: column-parallel projections, per head as in HF
                for mine, theirs in (
                    ("linear_q_down_proj", "q_a_proj"),
                    ("linear_q_up_proj", "q_b_proj"),
                    ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                    ("linear_kv_up_proj", "kv_b_proj"),
                ):
                    shards = tp_shards(src + f"self_attention.{mine}.weight", stage)
                    out[dst + f"self_attn.{theirs}.weight"] = _cat(shards, 0)
                for mine, theirs in (
                    ("q_layernorm", "q_a_layernorm"),
                    ("kv_layernorm", "kv_a_layernorm"),
                ):
                    key = (src + f"self_attention.{mine}.weight", stage, 0, 0)
                    out[dst + f"self_attn.{theirs}.weight"] = by[key]
            for kind in ("weight", "bias"):
                name = src + f"self_attention.linear_qkv.{kind}"
                if (name, stage, 0, 0) not in by:
                    continue
                qkv = _cat(tp_shards(name, stage), 0)
                per_group = qkv.reshape(groups, heads // groups + 2, d, *qkv.shape[1:])
                rest = qkv.shape[1:]
                out[dst + f"self_attn.q_proj.{kind}"] = per_group[:, : heads // groups].reshape(
                    heads * d, *rest
                )
                out[dst + f"self_attn.k_proj.{kind}"] = per_group[:, -2].reshape(groups * d, *rest)
                out[dst + f"self_attn.v_proj.{kind}"] = per_group[:, -1].reshape(groups * d, *rest)
            for mine, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                key = (src + f"self_attention.{mine}.weight", stage, 0, 0)
                if key in by and "kv_lora_rank" not in hf:
                    out[dst + f"self_attn.{theirs}.weight"] = by[key]
            out[dst + "self_attn.o_proj.weight"] = _cat(
                tp_shards(src + "self_attention.linear_proj.weight", stage), 1
            )
            if (src + "mlp.router.weight", stage, 0, 0) in by:  # a MoE layer
                out[dst + "mlp.gate.weight"] = by[(src + "mlp.router.weight", stage, 0, 0)]
                bias = (src + "mlp.router.expert_bias", stage, 0, 0)
                if bias in by:
                    out[dst + "mlp.gate.e_score_correction_bias"] = by[bias]
                if (src + "mlp.shared_experts.linear_fc1.weight", stage, 0, 0) in by:
                    gate, up = _fc1(tp_shards(src + "mlp.shared_experts.linear_fc1.weight", stage))
                    out[dst + "mlp.shared_experts.gate_proj.weight"] = gate
                    out[dst + "mlp.shared_experts.up_proj.weight"] = up
                    out[dst + "mlp.shared_experts.down_proj.weight"] = _cat(
                        tp_shards(src + "mlp.shared_experts.linear_fc2.weight", stage), 1
                    )
                for e in range(experts):
                    owner, local = divmod(e, experts // ep)
                    base = src + f"mlp.experts.local_experts.{local}."
                    fc1 = {r: by[(base + "linear_fc1.weight", stage, owner, r)] for r in range(etp)}
                    fc2 = {r: by[(base + "linear_fc2.weight", stage, owner, r)] for r in range(etp)}
                    gate, up = _fc1(fc1)  # expert TP cuts an expert as TP cuts a dense MLP
                    ex = dst + f"mlp.experts.{e}."
                    out[ex + "gate_proj.weight"] = gate
                    out[ex + "up_proj.weight"] = up
                    out[ex + "down_proj.weight"] = _cat(fc2, 1)
            else:
                gate, up = _fc1(tp_shards(src + "mlp.linear_fc1.weight", stage))
                out[dst + "mlp.gate_proj.weight"] = gate
                out[dst + "mlp.up_proj.weight"] = up
                out[dst + "mlp.down_proj.weight"] = _cat(
                    tp_shards(src + "mlp.linear_fc2.weight", stage), 1
                )
    return out


# --- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("job", list(JOBS))
def test_megatron_model_publishes_bitwise(
    cluster: LocalCluster, ranks: list[Rank], job: str
) -> None:
    spec = JOBS[job]
    hf, tp, pp, ep = spec["hf"], spec["tp"], spec["pp"], spec["ep"]
    groups: list[tuple[int, int, list[Engine], list[dict[str, torch.Tensor]]]] = []
    world = sum(n for n, _ in spec["engines"])
    first = 0
    for etp_size, eep in spec["engines"]:
        engines, received = engine_group(
            cluster, hf, etp_size, eep, f"megatron-{job}", first, world
        )
        groups.append((etp_size, eep, engines, received))
        first += etp_size
    for p in ranks:
        p.cmd(
            cmd="setup", job=f"megatron-{job}", hf=hf, tp=tp, pp=pp, ep=ep, etp=spec["etp"],
            divisible_by=DIVISIBLE_BY,
        )  # fmt: skip
    ready = [p.wait_for("ready", timeout=180) for p in ranks]
    if job == "dense":  # padded vocabulary: TP rank 1 holds rows 512..1000 of 1024
        emb = {e["tp"]: e["boxes"].get("model.embed_tokens.weight") for e in ready if e["pp"] == 0}
        assert emb == {0: [[0, 0], [512, 128]], 1: [[512, 0], [488, 128]]}
        stage1 = {n for e in ready if e["pp"] == 1 for n in e["boxes"]}
        assert "model.layers.1.self_attn.q_proj.weight" in stage1
        assert not any(n.startswith("model.layers.0.") for n in stage1)
    if job == "moe":  # expert TP 2: each rank holds half the rows of its experts' gate_proj
        gate = [e["boxes"].get("model.layers.0.mlp.experts.0.gate_proj.weight") for e in ready]
        assert sorted(g[0][0] for g in gate if g) == [0, 32], gate  # ep rank 0, etp 0 and 1
        assert all(g[1][0] == 32 for g in gate if g)
    if job == "kimi":  # the dense layer 0 on stage 0, the MoE layer 1 on stage 1
        stage1 = {n for e in ready if e["pp"] == 1 for n in e["boxes"]}
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in stage1
        assert not any(n.startswith("model.layers.0.") for n in stage1)
    if job == "tied":
        assert not any("lm_head.weight" in e["boxes"] for e in ready)
    for version in (1, 2, 3):  # 3: every parameter on new storage (offloaded and back)
        for p in ranks:
            p.cmd(cmd="publish", version=version, move=version == 3)
        sent = [p.wait_for("published")["bytes"] for p in ranks]
        assert sum(sent) > 0, sent
        files = sorted(out_dir(ranks).glob(f"megatron-{job}-v{version}-r*.pt"))
        assert len(files) == WORLD
        full = to_hf(hf, tp, pp, ep, spec["etp"], files)
        assert set(full) == {t.name for t in hf_tensors(hf)}
        for _, eep, engines, received in groups:
            check_engines(hf, full, eep, engines, received, version, job)
    for _, _, engines, _ in groups:
        for eng in engines:
            eng.close()


@pytest.mark.parametrize("job", ["moe", "kimi", "dense"])
def test_megatron_model_delta_versions_bitwise(
    cluster: LocalCluster, ranks: list[Rank], job: str
) -> None:
    """Sparse delta sync from Megatron's own parameters (grouped experts over EP and
    expert TP, fused fc1, interleaved QKV as views stepping over the groups) into
    SGLang-layout engines with delta areas (stacked, fused expert weights): a dense first
    version, then sparse steps sent as deltas, one of them after every parameter got new
    storage; every version bitwise against the test's own conversion (what slime's
    delta sync got wrong for grouped-MoE weights, slime#2209)."""
    spec = JOBS[job]
    hf, tp, pp, ep = spec["hf"], spec["tp"], spec["pp"], spec["ep"]
    name = f"megatron-delta-{job}"
    etp_size, eep = spec["engines"][0]
    engines, received = engine_group(cluster, hf, etp_size, eep, name, 0, etp_size, 0.5)
    for p in ranks:
        p.cmd(
            cmd="setup", job=name, hf=hf, tp=tp, pp=pp, ep=ep, etp=spec["etp"],
            divisible_by=DIVISIBLE_BY, delta="auto",
        )  # fmt: skip
    for p in ranks:
        p.wait_for("ready", timeout=180)
    for version in (1, 2, 3, 4):  # 1: dense (nothing held); 3: every parameter moved
        for p in ranks:
            p.cmd(cmd="publish", version=version, move=version == 3, sparse=version > 1)
        events = [p.wait_for("published") for p in ranks]
        files = sorted(out_dir(ranks).glob(f"{name}-v{version}-r*.pt"))
        assert len(files) == WORLD
        full = to_hf(hf, tp, pp, ep, spec["etp"], files)
        check_engines(hf, full, eep, engines, received, version, f"delta {job}")
        delta = sum(e["delta_bytes"] for e in events)
        dense = sum(e["bytes"] for e in events)
        if version > 1:  # deltas replaced most dense bytes
            assert delta > 0 and dense < 0.5 * sum(t.nbytes for r in received for t in r.values())
        for eng in engines:
            assert eng.delta is not None and eng.delta.held == version
    for eng in engines:
        eng.close()


@pytest.mark.parametrize(
    ("start", "stop"), [(0, 24), (3, 21), (5, 7), (6, 18), (8, 24), (0, 5), (19, 24)]
)
def test_merged_rows_box_is_the_rows_it_stands_for(start: int, stop: int) -> None:
    """A merged-rows view (4 groups of 6 rows of an 8-row-per-group tensor) cut at any rows:
    whole groups, partial ones, and both, as one torch.cat of the rows would give them."""
    base = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4, 8, 3)
    view = base[:, 1:7]  # rows 1..6 of each group: not one view of a 2-D tensor
    flat = torch.cat(list(view))  # the 24 x 3 tensor it stands for
    box = Box(offsets=(start, 1), sizes=(stop - start, 2))
    assert torch.equal(slice_box(view, box), flat[start:stop, 1:3])
    parts = row_parts(view, box)
    assert [row for row, _ in parts] == sorted(row for row, _ in parts)
    assert sum(p.numel() for _, p in parts) == (stop - start) * 2


def test_megatron_layout_that_does_not_map_names_the_parameter() -> None:
    """A local tensor that is no shard of its HF tensor, a parameter no family has, and
    legacy GroupedMLP experts (no box) raise RegistrationError naming each; nothing is
    returned."""
    from weightwire.client.megatron import Ranks, megatron_pieces
    from weightwire.protocol.errors import RegistrationError

    hf = CONFIGS["qwen3"]

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_number = 1
            self.input_layernorm = torch.nn.Linear(1, 1)  # .weight, .bias: a bias it has not
            self.mlp = torch.nn.Module()
            self.mlp.experts = torch.nn.Module()
            self.mlp.experts.weight1 = torch.nn.Parameter(torch.zeros(128, 512))  # GroupedMLP

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])
            self.final_layernorm = torch.nn.LayerNorm(hf["hidden_size"] + 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = Decoder()

    with pytest.raises(RegistrationError) as err:
        megatron_pieces(Model(), hf, Ranks())
    msg = err.value.message
    assert "decoder.layers.0.input_layernorm.bias" in msg
    assert "decoder.layers.0.mlp.experts.weight1 [128, 512]: is legacy GroupedMLP's" in msg
    assert "decoder.final_layernorm.weight [129]" in msg
    assert "nothing was registered" in msg


def test_grouped_experts_over_ep_and_expert_tp_are_boxes_of_their_experts() -> None:
    """Transformer Engine's grouped experts (`mlp.experts.linear_fc1.weightN`, which needs a
    GPU to build) on EP rank 1 of 2 and expert-TP rank 1 of 2, in layer 0 of the second
    pipeline stage (layer_number 2): experts 4..7 of HF layer 1, each fc1 the rank's rows of
    gate_proj then up_proj (views of the parameter, no copy), each fc2 its columns; the
    model inside DDP and Float16Module wrappers."""
    from weightwire.client.megatron import Ranks, megatron_pieces

    hf = CONFIGS["qwen3-moe"]  # 8 experts, moe_intermediate_size 64, hidden 128
    fc1, fc2 = torch.nn.Module(), torch.nn.Module()
    for j in range(4):
        fc1.register_parameter(f"weight{j}", torch.nn.Parameter(torch.randn(64, 128)))
        fc2.register_parameter(f"weight{j}", torch.nn.Parameter(torch.randn(128, 32)))
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    layer = torch.nn.Module()
    layer.layer_number = 2  # type: ignore[assignment]
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2 = fc1, fc2
    model.decoder.layers = torch.nn.ModuleList([layer])
    ddp = torch.nn.Module()  # Megatron's DDP and Float16Module keep the model as `.module`
    ddp.module = torch.nn.Module()
    ddp.module.module = model
    pieces = megatron_pieces(ddp, hf, Ranks(ep=1, ep_size=2, etp=1, etp_size=2))
    got = {p.name: (p.box.offsets, p.box.sizes, p.local.data_ptr()) for p in pieces}
    want = {}
    for j in range(4):
        e = f"model.layers.1.mlp.experts.{4 + j}."
        w1, w2 = getattr(fc1, f"weight{j}"), getattr(fc2, f"weight{j}")
        want[e + "gate_proj.weight"] = ((32, 0), (32, 128), w1.data_ptr())
        want[e + "up_proj.weight"] = ((32, 0), (32, 128), w1.data_ptr() + 32 * 128 * 4)
        want[e + "down_proj.weight"] = ((0, 32), (128, 32), w2.data_ptr())
    assert got == want


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(
    "transform", [Copy(), Cast(dtype="float32"), Fp8BlockQuant(block=4), Fp8BlockScale(block=4)]
)
def test_packing_a_merged_rows_box_gives_the_rows_it_stands_for(
    transform: Any, device: str
) -> None:
    """A bucket's pack ops over a merged-rows tensor (interleaved QKV's q rows), batched
    (`Packer.pack_bucket`; on a GPU, replayed as a CUDA graph the second time) and one by
    one (`Packer.pack`), write the same bytes as the same ops over the concatenated rows,
    for boxes that cut groups and span several."""
    from weightwire.client.pack import Packer
    from weightwire.protocol.plan import PackOp
    from weightwire.protocol.tensors import Piece, piece_nbytes

    torch.manual_seed(0)
    local = torch.randn(
        3 * 10, 8, dtype=torch.bfloat16, device=device
    )  # 3 groups: 8 q rows, 2 other
    view = local.view(3, 10, 8)[:, :8]  # the q rows: a 24 x 8 tensor, as a 3-D view
    flat = torch.cat(list(view))
    boxes = [Box(offsets=(0, 0), sizes=(24, 8)), Box(offsets=(4, 0), sizes=(16, 8))]
    boxes += [Box(offsets=(8, 4), sizes=(8, 4))]
    ops, offset = [], 0
    for box in boxes:
        n = piece_nbytes("bfloat16", Piece(source="q", box=box, dst_offset=0, transform=transform))
        ops.append(
            PackOp(source="q", box=box, transform=transform, staging_offset=offset, nbytes=n)
        )
        offset += -(-n // 16) * 16
    want = torch.zeros(offset, dtype=torch.uint8, device=device)
    for op in ops:
        Packer().pack(op, flat, want)
    batched = torch.zeros(offset, dtype=torch.uint8, device=device)
    Packer().pack_bucket(tuple(ops), {"q": view}, batched)
    assert torch.equal(batched, want)
    single = torch.zeros(offset, dtype=torch.uint8, device=device)
    for op in ops:
        Packer().pack(op, view, single)
    assert torch.equal(single, want)
    view.mul_(2)  # a new version, packed again through the same (cached) bucket
    flat = torch.cat(list(view))
    want.zero_()
    for op in ops:
        Packer().pack(op, flat, want)
    Packer().pack_bucket(tuple(ops), {"q": view}, batched)
    assert torch.equal(batched, want)
