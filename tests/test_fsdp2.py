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
from pathlib import Path
from typing import Any

import pytest
import torch

from weightwire.client import Engine
from weightwire.client.dtypes import TORCH
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import engine_tensors

from .jsonproc import JsonLinesProc
from .rulesref import CONFIGS, reference
from .test_rules import layout

pytestmark = pytest.mark.fsdp2
HERE = Path(__file__).parent
WORLD = 4
CFG: dict[str, Any] = dict(
    CONFIGS["qwen3"], vocab_size=1001, intermediate_size=250, num_hidden_layers=1
)


class Rank(JsonLinesProc):
    def wait_for(self, event: str, timeout: float = 120) -> dict[str, Any]:
        import time

        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events:
                    if e["event"] == "error":
                        raise AssertionError(f"rank failed: {e}\n{''.join(self.err)[-3000:]}")
                    if e["event"] == event and not e.get("seen"):
                        e["seen"] = True
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    raise AssertionError(
                        f"no {event} in {timeout} s: {self.events}\n{''.join(self.err)[-3000:]}"
                    )
                self._cv.wait(min(left, 0.2))

    def cmd(self, **kw: object) -> None:
        self.send(json.dumps(kw))


@pytest.fixture(scope="module")
def ranks(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    out = tmp_path_factory.mktemp("fsdp2")
    store = out / "store"
    procs = [
        Rank(
            HERE / "ranks" / "fsdp2_trainer.py",
            *("--socket", cluster.daemons[0].socket, "--store", str(store)),
            *("--rank", str(r), "--world", str(WORLD), "--out", str(out)),
            *("--config", json.dumps(CFG)),
            pythonpath=HERE.parent,
        )
        for r in range(WORLD)
    ]
    try:
        for p in procs:
            p.wait_for("started")
        yield procs
        for p in procs:
            p.cmd(cmd="close")
        for p in procs:
            assert p.finish() == 0, "".join(p.err)[-3000:]
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()


def out_dir(ranks: list[Rank]) -> Path:
    argv = ranks[0].p.args
    return Path(argv[argv.index("--out") + 1])


@pytest.mark.parametrize(
    ("mesh", "dtype"),
    [("1d", "bfloat16"), ("hsdp", "float32"), ("2d", "bfloat16")],  # float32: FSDP's masters
)
def test_fsdp2_module_publishes_bitwise(
    cluster: LocalCluster, ranks: list[Rank], mesh: str, dtype: str
) -> None:
    job = f"fsdp2-{mesh}"
    engines, received = [], []
    for r in range(2):
        lay = layout(CFG, 2, r, 1, "")
        tensors = {
            t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype]) for t in engine_tensors(CFG, lay)
        }
        eng = Engine(r, 2, socket=cluster.daemons[1].socket, job=job, timeout_s=60)
        eng.register(tensors, layout=lay)
        engines.append(eng)
        received.append(tensors)
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
        for r, eng in enumerate(engines):
            eng.wait(version, timeout_s=60)
            want = reference(CFG, full, 2, r, 1, None)
            assert set(want) == set(received[r])
            for n, expected in want.items():
                got = received[r][n]
                assert torch.equal(
                    got.view(torch.uint8), expected.contiguous().view(torch.uint8)
                ), f"{mesh} v{version} engine rank {r}: {n} differs from the unsharded model"
    for eng in engines:
        eng.close()


def _hf_names() -> list[Any]:
    from weightwire.plan.rules import hf_tensors

    return list(hf_tensors(CFG))
