"""`weightwire bench gpu` exercised on CPU (gloo instead of NCCL, tcp instead of CUDA IPC)
with a tiny Qwen3-MoE: the whole program runs (daemon, rank processes, both methods,
verification, links, stages, trace, the CPU-replica mode). Speed is never asserted.

The bytes the benchmark's verification expects are checked against the independent
reference of tests/rulesref.py, so a pass means the engines really hold the right bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightwire.bench.gpu import launcher
from weightwire.bench.gpu import model as M
from weightwire.client.pack import Packer
from weightwire.plan.rules import engine_tensors, hf_tensors
from weightwire.protocol.local import EngineLayout

from .rulesref import reference

ROOT = Path(__file__).resolve().parent.parent
# Qwen3-MoE shrunk: every FSDP-2 shard and TP-2 slice is whole 128x128 FP8 tiles; vocab
# padding (1000 rows) included
TINY = [
    "--layers",
    "2",
    "--set",
    "hidden_size=256",
    "--set",
    "num_attention_heads=2",
    "--set",
    "num_key_value_heads=2",
    "--set",
    "head_dim=128",
    "--set",
    "num_experts=4",
    "--set",
    "num_experts_per_tok=2",
    "--set",
    "moe_intermediate_size=256",
    "--set",
    "vocab_size=1000",
]


def tiny_config() -> dict[str, Any]:
    sets = [TINY[i + 1] for i in range(len(TINY)) if TINY[i] == "--set"]
    return M.load_config("data/models/qwen3-30b-a3b.json", 2, sets)


def bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "weightwire.cli",
        "bench",
        "gpu",
        "--device",
        "cpu",
        *TINY,
        "--versions",
        "1",
        "--json",
        "--workdir",
        str(tmp_path / "work"),
        "--timeout",
        "120",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"rc {out.returncode}\n{out.stderr[-6000:]}"
    return json.loads(out.stdout)


def check_run(run: dict[str, Any], baseline: bool = True) -> None:
    assert not run.get("error"), run.get("error")
    assert run["verified"]["weightwire"] is True
    assert run["verified"]["versions"] == 2  # the warm-up and one measured version
    assert run["weightwire_s"] > 0 and run["weightwire_gbps"] > 0
    assert run["bytes"] == sum(p["bytes"] for p in run["trainer_plans"])
    assert set(run["stages"]["weightwire"]) >= {"pack_s", "transfer_s", "total_s"}
    if baseline:
        assert run["verified"]["baseline"] is True
        assert run["baseline_s"] > 0
        assert run["speedup"] == pytest.approx(run["baseline_s"] / run["weightwire_s"])
        assert set(run["stages"]["baseline"]) >= {
            "all_gather_s",
            "broadcast_s",
            "copy_in_s",
            "total_s",
        }
    assert run["daemon_exit_codes"] and all(c == 0 for c in run["daemon_exit_codes"])


def test_pairs_json_table_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    r = bench(tmp_path, "--pairs", "2x2,1x1", "--trace", str(trace))
    for key in (
        "weightwire_s",
        "baseline_s",
        "speedup",
        "bytes",
        "weightwire_gbps",
        "links",
        "ports",
        "link_fraction",
        "stages",
        "gpus",
        "device_name",
        "versions",
        "targets",
    ):
        assert key in r, key
    assert r["ok"] is True and r["primary"] == "2x2"
    assert [run["pair"] for run in r["runs"]] == ["2x2", "1x1"]
    for run in r["runs"]:
        check_run(run)
        # every link the plan uses is a row: bytes add up to what the trainers write
        assert sum(row["bytes"] for row in run["links"]) == run["bytes"]
        for row in run["links"] + run["ports"]:
            assert row["rate_gbps"] > 0 and row["fraction"] >= 0
        assert run["busiest"]["floor_s"] == max(x["floor_s"] for x in run["links"] + run["ports"])
    two = r["runs"][0]
    assert {row["link"] for row in two["links"]} == {
        "cpu0->cpu2",
        "cpu0->cpu3",
        "cpu1->cpu2",
        "cpu1->cpu3",
    }
    assert two["targets"]["speedup"]["target"] == 3.0
    assert two["targets"]["link_fraction"]["target"] == 0.8

    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    # every bucket of every trainer: prepare, post wait, transfer, for both versions
    for run_index, run in enumerate(r["runs"]):
        for p in run["trainer_plans"]:
            pid = 1000 * (run_index + 1) + 1 + p["rank"]
            assert "trainer" in procs[pid]
            for stage in ("ww prepare", "ww post wait", "ww transfer"):
                got = [e for e in spans if e["pid"] == pid and e["cat"] == stage]
                assert len(got) == 2 * p["buckets"], (run["pair"], p["rank"], stage)
        base = [
            e for e in spans if e["cat"] == "base copy-in" and e["pid"] // 1000 == run_index + 1
        ]
        assert base
    assert {e["name"] for e in spans if e["cat"] == "weightwire"} >= {
        "weightwire v0",
        "weightwire v1",
    }


def test_fp8_destinations_fsdp_trainers(tmp_path: Path) -> None:
    r = bench(tmp_path, "--pairs", "2x2", "--dest", "fp8")
    assert r["dest"] == "fp8"
    check_run(r["runs"][0])
    bf16 = sum(r["runs"][0]["model"]["engine_bytes"])
    assert bf16 < r["runs"][0]["model"]["hf_bytes"]  # FP8 codes (+ scales) are smaller


def test_full_tensor_trainers_to_one_engine(tmp_path: Path) -> None:
    r = bench(tmp_path, "--pairs", "2x1", "--trainer-layout", "full")
    run = r["runs"][0]
    check_run(run)
    # whole-tensor trainers: the planner spreads the bytes over both
    assert all(p["bytes"] > 0 for p in run["trainer_plans"])


def test_cpu_replica_over_tcp(tmp_path: Path) -> None:
    r = bench(tmp_path, "--replica")
    run = r["runs"][0]
    check_run(run, baseline=False)
    assert run["mode"] == "replica" and "baseline_s" not in run
    stages = run["replica_stages"]
    for k in ("gpu_to_replica", "replica_to_gpu_over_tcp", "total"):
        assert stages[k]["bytes"] > 0 and stages[k]["gbps"] > 0
    # the trainer's daemon (host1, cuda off) sent the replica to the engines' daemon
    assert run["transports"]["host1"]["tcp"]["bytes_sent"] >= 2 * run["bytes"]
    assert r["weightwire_s"] == run["weightwire_s"]


def test_without_a_gpu_it_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightwire.cli", "bench", "gpu", *TINY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert out.returncode == 2
    assert "no GPU visible" in out.stderr


@pytest.mark.parametrize(("tp", "dest"), [(1, ""), (2, ""), (2, "fp8")])
def test_expected_bytes_match_the_reference(tp: int, dest: str) -> None:
    """The verification's expected bytes (recipes applied with client.pack to regenerated
    rows) equal the independent plain-torch reference of every engine tensor."""
    cfg = tiny_config()
    content = M.Content(torch.device("cpu"), max(M.numel(t.shape) for t in hf_tensors(cfg)))
    hf = {t.name: t for t in hf_tensors(cfg)}
    full = {name: content.rows(t, 0, t.shape[0], version=3) for name, t in hf.items()}
    assert all(torch.isfinite(x.float()).all() for x in full.values())
    for rank in range(tp):
        lay = EngineLayout(tp_size=tp, tp_rank=rank, model=cfg, dest_dtype=dest)
        want = reference(cfg, full, tp, rank, 1, 128 if dest == "fp8" else None)
        ets = engine_tensors(cfg, lay)
        assert {t.name for t in ets} == set(want)
        scratch = [torch.empty(max(M.nbytes(t) for t in ets), dtype=torch.uint8) for _ in "ab"]
        by_name = {t.name: t for t in ets}
        for t in ets:
            group = [t]
            partner = by_name.get(t.name + "_scale_inv")
            if M.lockstep(t, partner):
                assert partner is not None
                group.append(partner)
            got = M.expected(group, hf, content, 3, Packer(), scratch[: len(group)])
            for u, g in zip(group, got, strict=True):
                ref = want[u.name].contiguous().reshape(-1).view(torch.uint8)
                assert torch.equal(g, ref), (tp, rank, dest, u.name)


def test_contents_are_deterministic_and_versioned() -> None:
    cfg = tiny_config()
    t = next(x for x in hf_tensors(cfg) if x.name.endswith("embed_tokens.weight"))
    a = M.Content(torch.device("cpu"), 1 << 20)
    b = M.Content(torch.device("cpu"), 1 << 20)
    whole = a.rows(t, 0, t.shape[0], 1)
    assert torch.equal(whole.view(torch.int16), b.rows(t, 0, t.shape[0], 1).view(torch.int16))
    assert torch.equal(whole[10:20].view(torch.int16), b.rows(t, 10, 20, 1).view(torch.int16))
    assert not torch.equal(whole.view(torch.int16), a.rows(t, 0, t.shape[0], 2).view(torch.int16))
    x = whole.float().abs()
    assert (x >= 2**-9).all() and (x < 0.5).all() and (whole < 0).any()


def test_layers_are_reduced_to_fit_the_gpu() -> None:
    cfg = M.load_config("data/models/qwen3-30b-a3b.json")
    args = SimpleNamespace(
        layers="auto",
        trainer_layout="fsdp",
        dest="bf16",
        bucket_mb=1024,
        no_baseline=False,
        replica=False,
    )
    gib = 1 << 30
    # Qwen3-30B-A3B bf16 is 61 GB: 1 -> 1 on one 141 GB H200 fits (shard + staging),
    # on an 80 GB GPU it must shrink
    assert launcher.fit_layers(cfg, args, 1, 1, int(0.92 * 139.8 * gib))[0] == 48
    layers, why = launcher.fit_layers(cfg, args, 1, 1, int(0.92 * 79 * gib))
    assert 10 < layers < 48 and "reduced" in why
    s = M.sizes({**cfg, "num_hidden_layers": layers}, 1, "bf16")
    assert max(M.peak_bytes(s, 1, 1, False, 1 << 30, True)) <= int(0.92 * 79 * gib)
    args.layers = "7"  # a maximum: kept when it fits, reduced when it does not
    assert launcher.fit_layers(cfg, args, 1, 1, int(0.92 * 79 * gib))[0] == 7
    assert launcher.fit_layers(cfg, args, 2, 2, None) == (7, "--layers")
    args.layers, args.replica = "48", True
    layers, why = launcher.fit_layers(cfg, args, 1, 1, None, host_budget=10 * gib)
    assert 1 <= layers < 8 and "reduced from 48 (--layers)" in why


def test_staging_rings_compared_in_one_call(tmp_path: Path) -> None:
    """`--staging-buckets 0,2,2:landing`: one run per ring, each verified, the ring's
    throughput given against the whole send's, and its staging memory smaller (small
    buckets, so that the plan has more buckets than the ring has slots); `:landing` names
    how the trainer waits for slots (`rank --slot-wait`)."""
    r = bench(
        tmp_path,
        *("--pairs", "1x1", "--staging-buckets", "0,2,2:landing", "--no-baseline"),
        *("--daemon-flag", "bucket-bytes=262144", "--daemon-flag", "max-write-bytes=65536"),
    )
    whole, ring, landing = r["runs"]
    for run in (whole, ring, landing):
        check_run(run, baseline=False)
    assert landing["pair"] == "1x1 ring 2 landing" and landing["slot_wait"] == "landing"
    assert "slot_wait" not in ring
    assert [whole["staging_buckets"], ring["staging_buckets"]] == [0, 2]
    (plan0,), (plan2,) = whole["trainer_plans"], ring["trainer_plans"]
    assert plan0["staging_buckets"] == 0 and plan2["staging_buckets"] == 2
    assert plan0["staging_bytes"] == plan0["send_staging_bytes"]
    assert plan2["buckets"] > 2 and plan2["staging_bytes"] < plan0["staging_bytes"] / 2
    cmp, cmp_landing = r["staging_rings"]
    assert cmp["pair"] == "1x1 ring 2" and cmp["against"] == "1x1 ring 0"
    assert cmp_landing["pair"] == "1x1 ring 2 landing"
    assert cmp["ratio"] == pytest.approx(whole["weightwire_s"] / ring["weightwire_s"])
