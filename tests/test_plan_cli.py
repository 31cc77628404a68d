"""`weightwire plan`: its JSON and its bound against a count made here from the config alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from weightwire.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "data" / "models"


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def qwen3_dense_gpu_bytes(cfg: dict[str, Any], tp: int, rank: int, fp8: bool) -> int:
    """What one SGLang TP rank of a Qwen3 dense model holds, counted from the config:
    column-parallel q/k/v and gate/up, row-parallel o/down, vocab-parallel embeddings
    (padding to 64 rows never sent), norms whole. FP8: linear weights one byte per element
    plus a float32 scale per 128x128 tile of each fused segment; the rest bf16."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    assert tp <= nkv and nh % tp == 0 and nkv % tp == 0 and inter % tp == 0

    def tiles(n: int) -> int:
        return math.ceil(n / 128)

    def linear(segments_rows: list[int], cols: int) -> int:
        elems = sum(segments_rows) * cols
        if not fp8:
            return 2 * elems
        return elems + 4 * sum(tiles(r) for r in segments_rows) * tiles(cols)

    q, kv, i = nh // tp * hd, nkv // tp * hd, inter // tp
    layer = (
        linear([q, kv, kv], h)  # qkv_proj
        + linear([h], q)  # o_proj: all rows, this rank's columns
        + linear([i, i], h)  # gate_up_proj
        + linear([h], i)  # down_proj
        + 2 * (2 * hd + 2 * h)  # q_norm, k_norm, input/post-attention norms
    )
    padded = math.ceil(vocab / 64) * 64
    per = padded // tp
    rows = max(0, min(per, vocab - rank * per))  # padding rows stay zero on the engine
    vocab_bytes = 2 * rows * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * layer + vocab_bytes + 2 * h  # + final norm


@pytest.mark.parametrize(
    ("trainers", "engines", "dtype"),
    [(4, "2x2", "bf16"), (3, "2x2", "fp8"), (16, "1x4", "fp8"), (2, "1x1", "bf16")],
)
def test_qwen3_8b_json_and_bound(
    capsys: pytest.CaptureFixture[str], trainers: int, engines: str, dtype: str
) -> None:
    cfg = json.loads((MODELS / "qwen3-8b.json").read_text())
    j = run_json(
        capsys,
        "--model",
        str(MODELS / "qwen3-8b.json"),
        "--trainers",
        str(trainers),
        "--engines",
        engines,
        "--nic-gbit",
        "400",
        "--dtype",
        dtype,
    )
    for key in ("bytes_total", "bound_s", "simulated_s", "efficiency"):
        assert key in j
    replicas, tp = (int(x) for x in engines.split("x"))
    per_gpu = [qwen3_dense_gpu_bytes(cfg, tp, r, dtype == "fp8") for r in range(tp)] * replicas
    rate = 400e9 / 8
    bound = max(max(per_gpu) / rate, sum(per_gpu) / (trainers * rate))
    assert j["bound_s"] == pytest.approx(bound, rel=1e-12)
    assert j["bytes_total"] == sum(per_gpu)  # the plan sends exactly what engines need
    assert j["engine_bytes"]["max"] == max(per_gpu) and j["engine_bytes"]["min"] == min(per_gpu)
    assert j["simulated_s"] >= j["bound_s"] * (1 - 1e-12)
    assert 0 < j["efficiency"] <= 1
    assert j["efficiency"] == pytest.approx(j["bound_s"] / j["simulated_s"])
    assert len(j["busiest_engines"]) == min(5, replicas * tp)


def test_human_output_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "load.png"
    args = ["--model", str(MODELS / "qwen3-8b.json"), "--trainers", "4", "--engines", "2x2"]
    assert main(["plan", *args, "--nic-gbit", "200", "--dtype", "fp8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for word in ("bound", "simulated", "efficiency", "engine NICs", "trainer NICs", "busiest"):
        assert word in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--model", "x.json", "--trainers", "2", "--engines", "2by2"])
    missing = ["--trainers", "2", "--engines", "1x2", "--nic-gbit", "100", "--dtype", "bf16"]
    assert main(["plan", "--model", str(tmp_path / "none.json"), *missing]) == 2
    # 32 heads over TP 3 cannot be laid out: a plan error, not a traceback
    three = ["--trainers", "2", "--engines", "1x3", "--nic-gbit", "100", "--dtype", "bf16"]
    assert main(["plan", "--model", str(MODELS / "qwen3-8b.json"), *three]) == 1
    assert "divisible" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"num_hidden_layers": -1}, "'num_hidden_layers' is -1: it must be a positive integer"),
        ({"intermediate_size": 0}, "'intermediate_size' is 0"),
        ({"hidden_size": [4096]}, "'hidden_size' is [4096]"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' is '2'"),
        ({"num_hidden_layers": True}, "'num_hidden_layers' is True"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' is 0"),
        ({"head_dim": -128}, "'head_dim' is -128"),
    ],
)
def test_config_values_that_are_no_sizes_are_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, patch: dict[str, Any], needle: str
) -> None:
    """Each of these planned silently (a negative layer count: no layers; a zero
    intermediate size: empty tensors; kv heads 0: as many as the query heads; head_dim -128:
    boxes with negative offsets) or failed with a bare TypeError; now a plan error names it."""
    cfg = {**json.loads((MODELS / "qwen3-8b.json").read_text()), "num_hidden_layers": 2}
    model = tmp_path / "odd.json"
    model.write_text(json.dumps({**cfg, **patch}))
    args = ["--trainers", "2", "--engines", "1x2", "--nic-gbit", "100", "--dtype", "bf16"]
    assert main(["plan", "--model", str(model), *args]) == 1
    assert needle in capsys.readouterr().err


def test_a_config_that_is_no_json_object_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tmp_path / "list.json"
    model.write_text("[1, 2]")  # was AttributeError: 'list' object has no attribute 'get'
    args = ["--trainers", "2", "--engines", "1x2", "--nic-gbit", "100", "--dtype", "bf16"]
    assert main(["plan", "--model", str(model), *args]) == 2
    assert "list.json is not a JSON object" in capsys.readouterr().err


def test_llama_block_fp8_gets_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from .rulesref import CONFIGS

    model = tmp_path / "llama-fp8.json"
    model.write_text(json.dumps(CONFIGS["llama-fp8"]))
    args = ["--model", str(model), "--trainers", "2", "--engines", "1x2", "--nic-gbit", "100"]
    assert main(["plan", *args, "--dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "weight_scale_inv" in out, out
    j = run_json(capsys, *args, "--dtype", "fp8")
    assert len(j["caveats"]) == 1 and "Llama" in j["caveats"][0]
    assert run_json(capsys, *args, "--dtype", "bf16")["caveats"] == []


def test_progress_on_stderr_only_once_slow(capsys: pytest.CaptureFixture[str]) -> None:
    """Phase lines go to stderr once planning has taken --progress-after seconds (0 here,
    so every phase shows); with the default 2 s a small plan prints none. The text shows
    each trainer rank's staging (its whole send) and the plan hash."""
    args = ["--model", str(MODELS / "qwen3-8b.json"), "--trainers", "3", "--engines", "2x2"]
    args += ["--nic-gbit", "400", "--dtype", "fp8"]
    assert main(["plan", *args, "--progress-after", "0"]) == 0
    fast = capsys.readouterr()
    phases = [line for line in fast.err.splitlines() if line.startswith("...")]
    for phase in ("choosing the senders", "laying out staging", "cutting writes", "simulating"):
        assert any(phase in line for line in phases), (phase, phases)
    assert main(["plan", *args, "--progress-after", "1000"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    assert "staging         per trainer rank (its whole send" in quiet.out
    j = run_json(capsys, *args)
    hash_line = next(x for x in quiet.out.splitlines() if x.startswith("plan hash"))
    assert hash_line.split()[-1] == j["plan_hash"] and len(j["plan_hash"]) == 16
    staging = j["staging_per_trainer"]
    assert staging["max"] == j["staging_bytes_max"] > 0
    # each trainer rank stages what it packs: the bytes it sends, less what another
    # engine replica receives from the same pack
    assert 3 * staging["mean"] <= j["bytes_total"]


@pytest.mark.parametrize("slots", [0, 1, 2, 4, 1000])
def test_staging_ring_figure_is_what_each_trainer_allocates(slots: int) -> None:
    """`weightwire plan`'s ring figure, made on the columnar plan, against the ring each
    trainer rank actually allocates from its own RankPlan (protocol.plan.staging_ring)."""
    from weightwire.cli.plan_flows import flows_of
    from weightwire.cli.plan_ranks import Topology, engine_ranks, trainer_ranks
    from weightwire.plan.planner import PlanOptions, plan
    from weightwire.protocol.plan import staging_ring

    cfg = json.loads((MODELS / "qwen3-30b-a3b.json").read_text())
    cfg["num_hidden_layers"] = 3
    engines = engine_ranks(cfg, Topology(3, 2, 2, 2, 100.0), "bfloat16", range(2))
    plans = plan("ring", trainer_ranks(cfg, 3), engines, PlanOptions(bucket_bytes=64 << 20))
    flows = flows_of(plans, 3, slots)
    rings = {rp.rank: staging_ring(rp, slots).nbytes for np_ in plans.values() for rp in np_.sends}
    assert sorted(rings) == [0, 1, 2]
    assert flows.ring == [rings[r] for r in range(3)]
    if 0 < slots < 4:
        assert all(r < s for r, s in zip(flows.ring, flows.staging, strict=True))


def test_old_unit_flags_still_work_and_warn(capsys) -> None:  # type: ignore[no-untyped-def]
    """--nic-gbps and --pack-gbps became --nic-gbit and --pack-gbyte-s (units in the names)."""
    import argparse

    from weightwire.cli.plan import add_arguments

    p = argparse.ArgumentParser(prog="weightwire plan")
    add_arguments(p)
    base = ["--model", "m.json", "--trainers", "2", "--engines", "1x2", "--dtype", "bf16"]
    new = p.parse_args([*base, "--nic-gbit", "400", "--pack-gbyte-s", "110"])
    assert capsys.readouterr().err == ""
    old = p.parse_args([*base, "--nic-gbps", "400", "--pack-gbps", "110"])
    err = capsys.readouterr().err
    assert "--nic-gbps is deprecated, use --nic-gbit" in err
    assert "--pack-gbps is deprecated, use --pack-gbyte-s" in err
    assert (old.nic_gbps, old.pack_gbps) == (new.nic_gbps, new.pack_gbps) == (400.0, 110.0)
