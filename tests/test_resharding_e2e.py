"""Resharding through the real path: daemons, coordinator (recipes by the model-family
rules), trainer and engine clients. Trainers hold FSDP-2 dim-0 shards of HF tensors; engine
ranks declare SGLang-named tensors and leave the recipes to the rules; every engine tensor
is compared bitwise with the plain reference in tests/rulesref.py."""

from __future__ import annotations

import threading

import pytest
import torch

from weightwire.client import Engine, Shard, Trainer
from weightwire.client.dtypes import TORCH
from weightwire.harness.localcluster import LocalCluster
from weightwire.plan.rules import engine_tensors

from .hfweights import random_hf
from .rulesref import CONFIGS, reference
from .test_rules import fp8_block, layout


@pytest.mark.parametrize(
    ("name", "tp", "ep", "dest"),
    [
        ("qwen3-moe", 2, 1, ""),  # FSDP-2 -> TP-2 Qwen3-MoE
        ("qwen3-moe", 2, 2, ""),  # ... with expert parallelism
        ("qwen3", 4, 1, ""),  # TP-4 over 2 KV heads: replicated KV heads
        ("qwen3-fp8", 2, 1, "fp8"),  # BF16 trainers -> FP8 engines, quantized by the senders
    ],
)
def test_fsdp2_trainers_to_sglang_engines(
    cluster: LocalCluster, name: str, tp: int, ep: int, dest: str
) -> None:
    cfg = CONFIGS[name]
    job = f"reshard-{name}-{tp}-{ep}-{dest or 'bf16'}"
    engines, received = [], []
    for r in range(tp):
        lay = layout(cfg, tp, r, ep, dest)
        tensors = {
            t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype]) for t in engine_tensors(cfg, lay)
        }
        eng = Engine(r, tp, socket=cluster.daemons[1].socket, job=job, timeout_s=60)
        eng.register(tensors, layout=lay)
        engines.append(eng)
        received.append(tensors)

    trainers = []
    for version in (1, 2):
        hf = random_hf(cfg, seed=version)
        if not trainers:
            for r in range(2):
                tr = Trainer(r, 2, socket=cluster.daemons[0].socket, job=job, timeout_s=60)
                step = {n: -(-t.shape[0] // 2) for n, t in hf.items()}
                mine = {n: t[r * step[n] : (r + 1) * step[n]].clone() for n, t in hf.items()}
                tr.register(
                    mine,
                    layout=Shard(0, r, 2),
                    global_shapes={n: tuple(t.shape) for n, t in hf.items()},
                )
                trainers.append((tr, mine))
        for r, (_, mine) in enumerate(trainers):
            for n, t in hf.items():
                step = -(-t.shape[0] // 2)
                mine[n].copy_(t[r * step : (r + 1) * step])
        errors: list[BaseException] = []

        def publish(tr: Trainer, v: int = version, errors: list[BaseException] = errors) -> None:
            try:
                tr.publish(v)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=publish, args=(tr,)) for tr, _ in trainers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for r, eng in enumerate(engines):
            eng.wait(version)
            want = reference(cfg, hf, tp, r, ep, fp8_block(cfg, dest))
            assert set(want) == set(received[r]), set(want) ^ set(received[r])
            for n, expected in want.items():
                got = received[r][n]
                assert got.dtype == expected.dtype and got.shape == expected.shape, n
                assert torch.equal(
                    got.view(torch.uint8), expected.contiguous().view(torch.uint8)
                ), f"v{version} engine rank {r}: {n} differs from the reference"
    for tr, _ in trainers:
        tr.close()
    for eng in engines:
        eng.close()
