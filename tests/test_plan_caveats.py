"""The coordinator warns, once per plan, about what is known to go wrong on the engine side
for a model although weightwire's recipes are right (plan.rules.caveats)."""

from __future__ import annotations

import torch

from weightwire.client import Engine, Trainer
from weightwire.client.dtypes import TORCH
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import LLAMA_FP8_SCALES, engine_tensors, hf_tensors
from weightwire.protocol.local import EngineLayout

from .rulesref import CONFIGS


def test_a_llama_block_fp8_plan_is_logged_with_its_caveat(cluster: LocalCluster) -> None:
    cfg = CONFIGS["llama-fp8"]
    layout = EngineLayout(tp_size=1, tp_rank=0, dest_dtype="fp8", model=cfg)  # type: ignore[arg-type]
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job="llama-fp8", timeout_s=30)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job="llama-fp8", timeout_s=30)
    try:
        dst = {
            t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype]) for t in engine_tensors(cfg, layout)
        }
        assert any(n.endswith(".weight_scale_inv") for n in dst)
        eng.register(dst, layout=layout)
        tr.register({t.name: torch.ones(t.shape, dtype=TORCH[t.dtype]) for t in hf_tensors(cfg)})
        plan = tr.prepare(timeout_s=30)
        lines = [r for r in cluster.daemons[0].logs() if r.get("event") == "plan caveat"]
        assert [r["caveat"] for r in lines if r["plan"] == plan.plan_hash] == [LLAMA_FP8_SCALES]
        assert lines[-1]["level"] == "warning" and lines[-1]["job"] == "llama-fp8"
    finally:
        tr.close()
        eng.close()


def test_a_llama_block_fp8_replica_warns_where_it_is_built(caplog) -> None:  # type: ignore[no-untyped-def]
    """Replica-mode engines declare explicit recipes, so the coordinator never sees the
    model: the replica says it (SGLang itself is not needed to get that far)."""
    from weightwire.adapters.sglang.replica import _warn_caveats

    from .rulesref import FP8Q

    with caplog.at_level("WARNING", logger="weightwire.adapters.sglang.replica"):
        _warn_caveats(dict(CONFIGS["llama-fp8"], quantization_config=FP8Q), 2, 1)
        _warn_caveats(dict(CONFIGS["qwen3-fp8"], quantization_config=FP8Q), 2, 1)
        _warn_caveats(CONFIGS["llama"], 2, 1)
    assert [r.getMessage() for r in caplog.records] == [f"replica of llama: {LLAMA_FP8_SCALES}"]
