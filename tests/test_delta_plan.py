"""The plan side of delta sync: the simulator's delta flows, and the plan pass's layout."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from weightwire.plan.delta_sim import delta_flows


def test_delta_flows_sizes() -> None:
    mib = 1 << 20
    src, dst, nbytes, bucket = [0, 0, 0, 1], [0, 0, 1, 1], [32 * mib] * 4, [0, 0, 0, 1]
    f = delta_flows(src, dst, nbytes, bucket, density=0.01, width=2)
    # three (source, destination, bucket) payloads, then a trailer per (source, destination)
    assert f.payloads == 3 and f.dense_groups == 0 and len(f.nbytes) == 6
    payloads = f.nbytes[:3]
    assert np.all(payloads < 0.03 * np.array([64 * mib, 32 * mib, 32 * mib]))
    assert np.all(payloads > 0.02 * np.array([64 * mib, 32 * mib, 32 * mib]))  # 2 x density
    assert f.writes.tolist() == [2, 1, 1, 1, 1, 1]  # as many writes as the dense ones
    assert f.bucket.tolist()[3:] == [0, 0, 1]  # trailers with each source's last bucket
    dense = delta_flows(src, dst, nbytes, bucket, density=1.0, width=2)
    assert dense.dense_groups == 3 and dense.nbytes[:3].tolist() == [64 * mib, 32 * mib, 32 * mib]


def test_add_delta_layout_is_consistent() -> None:
    """Two trainers (dim-0 halves) -> two engines (one with a delta area): each sender gets
    a trailer and delta slots in that area, none overlapping, all inside it; the engine's
    expected immediates grow by one trailer per sender; the other engine is untouched."""
    import pytest
    import torch

    from weightwire.plan.delta import add_delta
    from weightwire.plan.planner import plan
    from weightwire.protocol.errors import PlanError
    from weightwire.protocol.regions import RegionDescriptor
    from weightwire.protocol.tensors import Box, Piece

    from .planlib import engine, trainer

    g = {"w": torch.zeros(64, 256, dtype=torch.bfloat16)}
    trainers = [
        trainer("t0", 0, g, {"w": Box.rows((64, 256), 0, 32)}),
        trainer("t1", 1, g, {"w": Box.rows((64, 256), 32, 64)}),
    ]
    full = (Piece(source="w", box=Box.full((64, 256)), dst_offset=0),)
    engines = [engine("e", r, [("w", "bfloat16", (64, 256), full)]) for r in (0, 1)]
    dense = plan("j", trainers, engines)
    area = RegionDescriptor(id=9, node="e", kind="cpu", length=16 << 10)
    plans = add_delta(dense, {("e", 0): area})
    assert plans.plan_hash != dense.plan_hash  # type: ignore[attr-defined]
    exp = {e.rank: e for e in plans["e"].expects}
    old = {e.rank: e for e in dense["e"].expects}
    assert exp[0].count == old[0].count + 2 and exp[0].delta_region == 9
    assert exp[1] == old[1]  # no area: unchanged
    spans = list(exp[0].trailers)
    for node in ("t0", "t1"):
        (rp,) = plans[node].sends
        assert len(rp.trailers) == 1 and rp.trailers[0].dst_rank == 0
        assert rp.shadow_bytes == rp.staging_bytes and rp.delta_bytes > 0
        for b in rp.buckets:
            for ds in b.deltas:
                assert ds.dst_rank == 0 and ds.width == 2
                assert all(b.writes[i].slot == ds.slot for i in ds.writes)
                spans.append((ds.dst_offset, ds.capacity))
                assert ds.src_offset + ds.capacity <= rp.delta_bytes
    spans.sort()
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] <= area.length
    tiny = RegionDescriptor(id=9, node="e", kind="cpu", length=64)
    with pytest.raises(PlanError, match="trailers alone need"):
        add_delta(dense, {("e", 0): tiny})


def test_share_keys_sends_every_copy_of_a_chunk_from_one_rank() -> None:
    """Three trainer ranks holding every byte, four engine replicas: without share_keys the
    replicas' copies of a chunk are spread over the ranks (each stages and compares its
    own); with it each chunk comes from one rank, staged once (the send stays balanced),
    and every chunk still goes to every replica."""
    import torch

    from weightwire.plan.options import PlanOptions
    from weightwire.plan.planner import plan
    from weightwire.protocol.tensors import Box, Piece

    from .planlib import engine, trainer

    shape = (64, 256)
    g = {f"w{i}": torch.zeros(*shape, dtype=torch.bfloat16) for i in range(8)}
    full = {n: Box.full(shape) for n in g}
    trainers = [trainer(f"t{r}", r, g, full) for r in range(3)]
    pieces = [
        (n, "bfloat16", shape, (Piece(source=n, box=Box.full(shape), dst_offset=0),)) for n in g
    ]
    engines = [engine(f"e{r}", r, pieces) for r in range(4)]
    total = sum(t.nbytes for t in g.values())

    def staged(share: bool) -> tuple[int, list[int]]:
        p = plan("j", trainers, engines, PlanOptions(bucket_bytes=64 << 10, share_keys=share))
        sends = [rp for node in p for rp in p[node].sends]
        sent = [sum(w.nbytes for b in rp.buckets for w in b.writes) for rp in sends]
        return sum(rp.staging_bytes for rp in sends), sent

    spread, _ = staged(False)
    once, sent = staged(True)
    assert spread > 2 * total and once == total, (spread, once, total)
    assert sum(sent) == 4 * total and max(sent) <= 1.5 * total  # still balanced


def test_flow_landing_times() -> None:
    """`simulate(land=True)`: each (source, destination, bucket) flow lands when its pair
    has delivered every byte posted up to it (a pair is a FIFO), exactly in these cases."""
    from weightwire.plan.simulate import simulate

    # two sources share one 100 B/s engine NIC fairly (50 B/s each) until one drains
    r = simulate(
        [0, 0, 0, 1, 1, 1], [0] * 6, [100, 200, 300, 100, 100, 100], [0, 1, 2, 0, 1, 2],
        [1000, 1000], [100], land=True, rel_tol=0,
    )  # fmt: skip
    assert r.flow_land is not None and r.flow_src is not None and r.flow_bucket is not None
    keys = zip(r.flow_src, r.flow_bucket, r.flow_land, strict=True)
    got = {(int(s), int(b)): float(t) for s, b, t in keys}
    want = {(0, 0): 2, (0, 1): 6, (0, 2): 9, (1, 0): 2, (1, 1): 4, (1, 2): 6}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-6 for k in want), got
    # packing at 100 B/s: each bucket is posted once packed and lands 1 s later
    r = simulate([0, 0, 0], [0, 0, 0], [100] * 3, [0, 1, 2], [100], [1000], pack_rate=100,
                 land=True, rel_tol=0)  # fmt: skip
    assert r.flow_land is not None
    assert sorted(r.flow_land.tolist()) == pytest.approx([2.0, 3.0, 4.0])
    assert r.seconds == pytest.approx(4.0)


def test_verify_queue() -> None:
    """One engine checks flows one at a time in landing order, each once it landed."""
    from weightwire.plan.delta_sim import verify_queue

    done = verify_queue(
        np.array([0, 0, 0, 2]),
        np.array([3.0, 1.0, 2.0, 5.0]),
        np.array([0.5, 0.5, 2.0, 1.0]),
        3,
    )
    # engine 0: lands 1 (0.5: done 1.5), 2 (2.0: done 4.0), 3 (0.5: 4.5); engine 1 gets none
    assert done.tolist() == pytest.approx([4.5, 0.0, 6.0])


def test_plan_delta_verifies_bucket_by_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    """`weightwire plan --delta-density`: each engine checksums a bucket once it landed,
    overlapped with the network; only what is left after its last byte is on the tail. With
    a fast checksum that is far below checking everything after the last byte; with a slow
    one the version can never be faster than one engine's whole checksum."""
    import json

    from weightwire.cli.main import main

    model = str(Path(__file__).resolve().parent.parent / "data" / "models" / "qwen3-8b.json")
    args = ["plan", "--model", model, "--trainers", "4", "--engines", "2x2", "--nic-gbit",
            "100", "--dtype", "bf16", "--delta-density", "0.01", "--json"]  # fmt: skip
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)["delta"]
    assert d["verify_overlapped"] and 0 < d["verify_s"] < 0.25 * d["verify_busy_s"], d
    assert d["simulated_s"] == pytest.approx(d["network_s"] + d["verify_s"])
    assert main([*args, "--delta-verify-gbyte-s", "2"]) == 0
    slow = json.loads(capsys.readouterr().out)["delta"]
    assert slow["simulated_s"] >= slow["verify_busy_s"] > slow["network_s"], slow
    assert slow["verify_s"] < slow["verify_busy_s"]  # what landed first was checked meanwhile
    assert main([*args, "--delta-apply-gbyte-s", "5"]) == 0  # payloads' scatter in the queue
    applied = json.loads(capsys.readouterr().out)["delta"]
    assert applied["apply_busy_s"] > 0 and applied["simulated_s"] > d["simulated_s"], applied
    assert applied["simulated_s"] >= applied["apply_busy_s"]


def test_expect_names_each_trailers_sender_and_planned_ranges() -> None:
    """Per trailer slot of a delta area the engine rank's Expect names the sender (node,
    rank) and the ranges the plan routes from it there: exactly what that sender's
    trailer says (`trailer_ranges`, in plan order)."""
    import torch

    from weightwire.plan.delta import add_delta, trailer_ranges
    from weightwire.plan.planner import plan
    from weightwire.protocol.regions import RegionDescriptor
    from weightwire.protocol.tensors import Box, Piece

    from .planlib import engine, trainer

    g = {n: torch.zeros(64, 256, dtype=torch.bfloat16) for n in ("w", "v")}
    halves = [{n: Box.rows((64, 256), 32 * r, 32 * r + 32) for n in g} for r in (0, 1)]
    trainers = [trainer(f"t{r}", r, g, halves[r]) for r in (0, 1)]
    pieces = [
        (n, "bfloat16", (64, 256), (Piece(source=n, box=Box.full((64, 256)), dst_offset=0),))
        for n in g
    ]
    engines = [engine("e", 0, pieces)]
    area = RegionDescriptor(id=9, node="e", kind="cpu", length=64 << 10)
    plans = add_delta(plan("j", trainers, engines), {("e", 0): area})
    (exp,) = plans["e"].expects
    assert len(exp.senders) == len(exp.planned) == len(exp.trailers) == 2
    for (node, rank), planned in zip(exp.senders, exp.planned, strict=True):
        (rp,) = plans[node].sends
        (t,) = rp.trailers
        assert rp.rank == rank and t.dst_offset == exp.trailers[exp.senders.index((node, rank))][0]
        assert list(planned) == trailer_ranges(rp, t) and planned
    assert not set(exp.planned[0]) & set(exp.planned[1])  # each rank its own rows
