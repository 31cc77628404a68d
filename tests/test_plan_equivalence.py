"""The columnar planner equals the straightforward one (tests/planref.py), write for write
and pack for pack, on small models of every family: dense, MoE, FP8, several TP/EP
layouts and engine replicas; trainers holding everything (the run-wise choice), FSDP
shards (one holder per chunk), and both at once (overlapping holder groups: the plain
choice); small buckets and writes (tensors split over buckets, writes cut and gathered
into strided runs), several lanes, zero-copy sources, the tied embedding read twice."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from weightwire.cli.plan_ranks import Topology, engine_ranks, trainer_ranks
from weightwire.plan.planner import EngineRank, PlanOptions, TrainerRank, plan
from weightwire.protocol.plan import NodePlan
from weightwire.protocol.tensors import Box

from .planref import plan_reference
from .rulesref import CONFIGS

ROOT = Path(__file__).resolve().parent.parent


def unhashed(p: NodePlan) -> NodePlan:
    sends = tuple(msgspec.structs.replace(s, plan_hash="") for s in p.sends)
    return msgspec.structs.replace(p, plan_hash="", sends=sends)


def assert_same(trainers: list[TrainerRank], engines: list[EngineRank], opts: PlanOptions) -> None:
    fast = plan("job", trainers, engines, opts)
    ref = plan_reference("job", trainers, engines, opts)
    assert sorted(fast) == sorted(ref)
    writes = 0
    for node in ref:
        got, want = unhashed(fast[node]), unhashed(ref[node])
        for a, b in zip(got.sends, want.sends, strict=True):
            assert a.staging_bytes == b.staging_bytes and a.regions == b.regions, node
            assert len(a.buckets) == len(b.buckets), node
            for x, y in zip(a.buckets, b.buckets, strict=True):
                assert x.packs == y.packs, (node, a.rank, x.index)
                assert x.writes == y.writes, (node, a.rank, x.index)
                assert x == y
            writes += a.write_count
        assert got == want, node
    assert writes == fast.write_count
    assert fast.plan_hash == next(iter(fast.values())).plan_hash


def fsdp(trainers: list[TrainerRank], world: int, tile: int) -> list[TrainerRank]:
    """FSDP dim-0 shards, rounded to `tile` rows (FP8 blocks come whole from one rank)."""
    out = []
    for t in trainers[:world]:
        held = []
        for s in t.tensors:
            n = s.shape[0]
            per = -(-n // world)
            step = -(-per // tile) * tile
            lo, hi = min(n, t.rank * step), min(n, t.rank * step + step)
            held.append(msgspec.structs.replace(s, box=Box.rows(s.shape, lo, hi)))
        out.append(replace(t, tensors=tuple(held)))
    return out


CASES = [
    # config, engines (replicas, tp, ep), dest dtype, trainers, options
    ("qwen3", (2, 2, 1), "bfloat16", "whole3", {}),
    ("qwen3-tied", (1, 2, 1), "bfloat16", "whole3", {}),
    ("llama-bias", (2, 4, 1), "bfloat16", "fsdp2", {}),
    ("qwen3-moe", (2, 2, 2), "bfloat16", "whole3", {}),
    ("qwen3-moe", (1, 4, 2), "bfloat16", "fsdp2", {}),
    ("qwen3-moe", (3, 4, 4), "bfloat16", "mixed", {}),
    ("qwen3-fp8", (2, 2, 1), "fp8", "whole3", {}),
    ("qwen3-moe-fp8", (2, 2, 2), "fp8", "fsdp2", {}),
    ("deepseek-v3", (2, 4, 4), "bfloat16", "whole3", {}),
    ("deepseek-v3-fp8", (2, 2, 2), "fp8", "mixed", {}),
    ("kimi-k2", (2, 4, 2), "bfloat16", "whole3", {}),
    ("kimi-k2", (2, 2, 2), "bfloat16", "whole3", {"bucket_bytes": 1 << 16}),
    ("qwen3-moe", (2, 2, 2), "bfloat16", "whole3", {"bucket_bytes": 40_000}),
    # a tapered tail: the last bucket_bytes of each send in buckets of tail_bytes
    ("kimi-k2", (2, 2, 2), "bfloat16", "whole3", {"bucket_bytes": 1 << 16, "tail_bytes": 9000}),
    ("qwen3-moe", (3, 4, 4), "bfloat16", "mixed", {"bucket_bytes": 40_000, "tail_bytes": 7000}),
    ("qwen3-moe-fp8", (2, 2, 2), "fp8", "fsdp2", {"bucket_bytes": 1 << 15, "tail_bytes": 4096}),
    (
        "qwen3-moe",
        (2, 2, 1),
        "bfloat16",
        "fsdp2",
        {"bucket_bytes": 1 << 15, "max_write_bytes": 4096, "min_stripe_bytes": 512},
    ),
    (
        "deepseek-v3",
        (1, 4, 2),
        "bfloat16",
        "lanes",
        {"max_write_bytes": 8192, "min_stripe_bytes": 999},
    ),
    ("qwen3", (2, 2, 1), "bfloat16", "lanes", {"max_write_bytes": 2048, "min_stripe_bytes": 256}),
]


def trainers_of(cfg: dict[str, Any], kind: str, dest: str) -> list[TrainerRank]:
    whole = trainer_ranks(cfg, 3)
    tile = 128 if dest == "fp8" or "quantization_config" in cfg else 1
    if kind == "whole3":
        return whole
    if kind == "fsdp2":
        return fsdp(whole, 2, tile)
    if kind == "mixed":  # a replica of whole tensors beside FSDP shards: groups overlap
        return [*fsdp(whole, 2, tile), replace(whole[2], node="trainer-2")]
    assert kind == "lanes"
    return [replace(t, lanes=1 + t.rank) for t in whole]


@pytest.mark.parametrize(("name", "eng", "dest", "kind", "opts"), CASES)
def test_columnar_planner_equals_the_straightforward_one(
    name: str, eng: tuple[int, int, int], dest: str, kind: str, opts: dict[str, int]
) -> None:
    cfg = CONFIGS[name]
    replicas, tp, ep = eng
    engines = engine_ranks(cfg, Topology(3, replicas, tp, ep, 100.0), dest, range(replicas))
    if kind == "lanes":
        engines = [replace(e, lanes=2) for e in engines]
    assert_same(trainers_of(cfg, kind, dest), engines, PlanOptions(**opts))


def test_zero_copy_sources_equal() -> None:
    """Trainers whose tensors lie in a registered region: written from there, not packed."""
    cfg = CONFIGS["qwen3"]
    ts = trainer_ranks(cfg, 2)
    placed, offset = [], 0
    for s in ts[0].tensors:
        placed.append(msgspec.structs.replace(s, region=5, offset=offset))
        offset += -(-(2 * Box.full(s.shape).numel) // 64) * 64
    ts = [replace(t, tensors=tuple(placed)) for t in ts]
    engines = engine_ranks(cfg, Topology(2, 2, 2, 1, 100.0), "bfloat16", range(2))
    assert_same(ts, engines, PlanOptions(max_write_bytes=8192))


def test_engines_on_shared_nodes_and_explicit_slots() -> None:
    """Several engine ranks per node (node order is not rank order), slots given."""
    cfg = CONFIGS["qwen3-moe"]
    ts = trainer_ranks(cfg, 2)
    engines = engine_ranks(cfg, Topology(2, 2, 2, 2, 100.0), "bfloat16", range(2))
    shared = []
    for e in engines:  # ranks 0, 2 on node-b and 1, 3 on node-a; a region id per rank
        node = f"node-{'ba'[e.rank % 2]}"
        region = msgspec.structs.replace(e.regions[0], node=node, id=e.rank + 1)
        tensors = tuple(msgspec.structs.replace(t, region=e.rank + 1) for t in e.tensors)
        shared.append(replace(e, node=node, regions=(region,), tensors=tensors))
    engines = shared
    fast = plan("job", ts, engines, slots={e.rank: 10 + e.rank for e in engines})
    ref = plan_reference("job", ts, engines, slots={e.rank: 10 + e.rank for e in engines})
    assert {n: unhashed(p) for n, p in fast.items()} == {n: unhashed(p) for n, p in ref.items()}


def test_kimi_k2_plans() -> None:
    """The Kimi-K2 job of `weightwire plan`'s documentation completes (256 trainers, 8x16
    FP8 engines); how long it takes is measured (README), never asserted. Each engine is
    written exactly the bytes it needs; node plans are made for a trainer and an engine."""
    from weightwire.plan.bound import received_bytes

    cfg = json.loads((ROOT / "data" / "models" / "kimi-k2.json").read_text())
    topo = Topology(256, 8, 16, 16, 400.0)
    engines = engine_ranks(cfg, topo, "fp8", range(topo.replicas))
    plans = plan("kimi", trainer_ranks(cfg, 256), engines)
    c = plans.compact
    assert len(plans) == 256 + 128
    need = [received_bytes(e.tensors) for e in engines]
    assert c.expect_bytes.tolist() == need
    written = np.bincount(c.writes.engine, weights=c.writes.nbytes, minlength=len(engines))
    assert written.astype(np.int64).tolist() == need
    assert plans["engine-3-7"].expects[0].nbytes == need[3 * 16 + 7]
    rp = plans["trainer-17"].sends[0]
    assert rp.write_count == int((c.packs.b_trainer[c.writes.bucket] == 17).sum()) > 0
    assert rp.staging_bytes == sum(b.nbytes for b in rp.buckets)


def test_the_hash_follows_the_engines_cuda_keys() -> None:
    """An engine rank that released its GPU memory is advertised without its CUDA key, and
    with a new one once resumed: each is a new plan, so that a writer on another daemon
    lets its mapping of the old memory go (the same hash kept it writing there)."""
    from weightwire.protocol.regions import CudaKey, RegionKeys

    cfg = CONFIGS["qwen3"]
    ts = trainer_ranks(cfg, 2)
    engines = engine_ranks(cfg, Topology(2, 2, 2, 1, 100.0), "bfloat16", range(2))

    def keyed(handle: bytes | None) -> list[EngineRank]:
        out = []
        for e in engines:
            cuda = (
                None
                if handle is None
                else CudaKey(host_id="h", device_uuid="GPU-0", ipc_handle=handle)
            )
            regions = tuple(
                msgspec.structs.replace(r, keys=RegionKeys(cuda=cuda)) for r in e.regions
            )
            out.append(replace(e, regions=regions))
        return out

    hashes = [plan("job", ts, keyed(h)).plan_hash for h in (b"a" * 64, None, b"b" * 64, b"b" * 64)]
    assert hashes[0] != hashes[1] != hashes[2] and hashes[2] == hashes[3]
