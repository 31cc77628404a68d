"""FSDP2 trainers registered as they are (`Trainer.register_module`), through real daemons
into TP-2 engines (SGLang layout, recipes from the model-family rules), checked bitwise
against the unsharded model (torch's own `full_tensor()` of every parameter).

Four real torch.distributed ranks (gloo, CPU) run `fully_shard` on a tiny Qwen3 whose
shapes do not divide evenly (vocab 1001 and intermediate 250 over 4 or 2 shards): a 1-D
mesh, HSDP (2 replicas x 2 shards) and a 2-D mesh (FSDP over ColwiseParallel /
RowwiseParallel TP, so `_StridedShard` placements); HSDP with float32 parameters (FSDP's
masters, cast to the engines' bfloat16 by the senders). The same four processes serve all
three, one job each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightwire.harness.localcluster import LocalCluster

from .multirank import Rank, check_engines, engine_group, out_dir, rank_procs
from .rulesref import CONFIGS

pytestmark = pytest.mark.fsdp2
WORLD = 4
CFG: dict[str, Any] = dict(
    CONFIGS["qwen3"], vocab_size=1001, intermediate_size=250, num_hidden_layers=1
)


@pytest.fixture(scope="module")
def ranks(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    out = tmp_path_factory.mktemp("fsdp2")
    with rank_procs("fsdp2_trainer.py", cluster, out, WORLD, "--config", json.dumps(CFG)) as procs:
        yield procs


@pytest.mark.parametrize(
    ("mesh", "dtype"),
    [("1d", "bfloat16"), ("hsdp", "float32"), ("2d", "bfloat16")],  # float32: FSDP's masters
)
def test_fsdp2_module_publishes_bitwise(
    cluster: LocalCluster, ranks: list[Rank], mesh: str, dtype: str
) -> None:
    job = f"fsdp2-{mesh}"
    engines, received = engine_group(cluster, CFG, 2, 1, job, 0, 2)
    for p in ranks:
        p.cmd(cmd="setup", mesh=mesh, job=job, dtype=dtype)
    ready = [p.wait_for("ready") for p in ranks]
    boxes = [e["boxes"] for e in ready]
    if mesh == "1d":  # uneven: 1001 rows over 4 ranks
        got = [b["model.embed_tokens.weight"] for b in boxes]
        assert [rows[1][0] for rows in got] == [251, 251, 251, 248]
    if mesh == "hsdp":  # replicas hold the same boxes
        assert boxes[0] == boxes[2] and boxes[1] == boxes[3] and boxes[0] != boxes[1]
    if mesh == "2d":  # FSDP over TP: q_proj's rows cut by TP first, then by FSDP
        q = [b["model.layers.0.self_attn.q_proj.weight"] for b in boxes]
        assert [(off[0], size[0]) for off, size in q] == [(0, 64), (128, 64), (64, 64), (192, 64)]
    for version in (1, 2):
        for p in ranks:
            p.cmd(cmd="publish", version=version)
        sent = [p.wait_for("published")["bytes"] for p in ranks]
        assert all(n > 0 for n in sent), sent  # HSDP: both replicas send a share
        full = torch.load(out_dir(ranks) / f"{job}-v{version}.pt")
        assert set(full) == {t.name for t in _hf_names()}
        assert all(t.dtype == getattr(torch, dtype) for t in full.values())
        full = {n: t.to(torch.bfloat16) for n, t in full.items()}  # the engines' dtype
        check_engines(CFG, full, 1, engines, received, version, mesh)
    for eng in engines:
        eng.close()


def _hf_names() -> list[Any]:
    from weightwire.plan.rules import hf_tensors

    return list(hf_tensors(CFG))
