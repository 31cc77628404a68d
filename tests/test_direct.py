"""Colocated packing (`client/direct.py`): pack ops moved from staging to where their bytes
land give, packed straight into the destination regions, exactly the bytes that staging
plus the writes give (CPU, real plans: FSDP to TP, strided experts, FP8 codes and scales);
buckets that do not qualify stay on the staging path. The GPU end to end (real daemons,
trainer and engine on one GPU, in place, bitwise) is in test_gpu_e2e.py."""

from __future__ import annotations

import msgspec
import pytest
import torch

from weightwire.client import direct as directmod
from weightwire.client.direct import Direct
from weightwire.client.pack import Packer
from weightwire.plan.planner import PlanOptions, plan
from weightwire.protocol.plan import RankPlan
from weightwire.protocol.regions import CudaKey, RegionKeys
from weightwire.protocol.tensors import Box, Fp8BlockQuant, Fp8BlockScale, Piece

from .planlib import check_bitwise, engine, execute, slice_of, trainer
from .test_planner import fsdp, model, tp_pieces

UUID = "GPU-test"


def _on_gpu(rp: RankPlan, other: set[int] = frozenset()) -> RankPlan:  # type: ignore[assignment]
    """The plan as if its destination regions were GPU memory of this rank's GPU (those
    of ranks in `other`: of another GPU)."""
    regions = tuple(
        msgspec.structs.replace(
            r,
            kind="gpu",
            keys=RegionKeys(
                cuda=CudaKey(
                    host_id="h",
                    device_uuid="GPU-other" if r.id - 1 in other else UUID,
                    ipc_handle=b"\0" * 64,
                )
            ),
        )
        for r in rp.regions
    )
    return msgspec.structs.replace(rp, regions=regions)


def _in_place(plans, ts, es, g, monkeypatch, other=frozenset()):  # type: ignore[no-untyped-def]
    """Every trainer rank's buckets packed in place where they qualify; returns the
    engines' regions and how many buckets went in place / through staging."""
    regions = {
        (e.node, r.id): torch.zeros(r.length, dtype=torch.uint8) for e in es for r in e.regions
    }
    owner = {(e.node, r.id): e.rank for e in es for r in e.regions}
    monkeypatch.setattr(directmod, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(Direct, "_region", lambda self, desc, device: regions[(desc.node, desc.id)])
    counts = [0, 0]
    for t in ts:
        local = {s.name: slice_of(g[s.name], s.held()).clone() for s in t.tensors}
        rp = _on_gpu(next(s for s in plans[t.node].sends if s.rank == t.rank), other)
        d, packer = Direct(), Packer()
        for bucket in rp.buckets:
            targets = d._make(rp, bucket, torch.device("cpu"))
            counts[targets is None] += 1
            for region, ops in targets or ():
                packer.pack_bucket(ops, local, region)
    return {owner[k]: v for k, v in regions.items()}, counts


@pytest.mark.parametrize(("trainers", "tp"), [(2, 2), (3, 2), (1, 3)])
def test_fsdp_to_tp_in_place_bitwise(trainers: int, tp: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = model()
    ts = [trainer("T", r, g, fsdp(r, trainers, g)) for r in range(trainers)]
    es = [engine("E", r, tp_pieces(g, r, tp)) for r in range(tp)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=512, max_write_bytes=300))
    got, (direct, staged) = _in_place(plans, ts, es, g, monkeypatch)
    assert direct and not staged
    check_bitwise(got, es, g)
    want = execute(plans, ts, es, g)
    for rank, region in want.items():
        assert torch.equal(got[rank], region)


def test_strided_experts_and_fp8_in_place_bitwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Stacked experts (strided writes) and FP8 codes and scales of them, each engine
    rank a column half."""
    experts, rows, cols = 8, 256, 260
    gen = torch.Generator().manual_seed(3)
    g = {
        f"layers.0.mlp.experts.{e}.down": torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        for e in range(experts)
    }
    ts = [trainer("T", r, g, fsdp(r, 2, g)) for r in range(2)]
    half = cols // 2
    tiles = -(-rows // 128) * -(-half // 128)

    def dests(r: int) -> list:  # type: ignore[type-arg]
        box = Box.rows((rows, cols), r * half, r * half + half, dim=1)
        names = [f"layers.0.mlp.experts.{e}.down" for e in range(experts)]
        return [
            ("w2", "bfloat16", (experts, rows, half),
             tuple(Piece(source=n, box=box, dst_offset=e * rows * half * 2)
                   for e, n in enumerate(names))),
            ("w2_fp8", "float8_e4m3fn", (experts, rows, half),
             tuple(Piece(source=n, box=box, dst_offset=e * rows * half, transform=Fp8BlockQuant())
                   for e, n in enumerate(names))),
            ("w2_scale", "float32", (experts, -(-rows // 128), -(-half // 128)),
             tuple(Piece(source=n, box=box, dst_offset=e * tiles * 4, transform=Fp8BlockScale())
                   for e, n in enumerate(names))),
        ]  # fmt: skip

    es = [engine("E", r, dests(r)) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions(max_write_bytes=1 << 16))
    assert any(w.count > 1 for s in plans["T"].sends for b in s.buckets for w in b.writes)
    want = execute(plans, ts, es, g)
    got, (direct, staged) = _in_place(plans, ts, es, g, monkeypatch)
    assert direct and not staged
    for rank, region in want.items():
        assert torch.equal(got[rank], region), f"engine rank {rank}"


def test_fp8_scales_are_hoisted_into_their_codes_bucket_bitwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A plan lays out codes regions before scales regions, so with small buckets a box's
    scales fall in a later bucket than its codes: `_make_all` moves each such scale op into
    its codes' bucket (one kernel read per tile), never into a later one, leaves every
    bucket an op, and the regions come out bitwise as planned."""
    experts, rows, cols = 6, 256, 256
    gen = torch.Generator().manual_seed(5)
    names = [f"layers.0.mlp.experts.{e}.down" for e in range(experts)]
    g = {n: torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for n in names}
    ts = [trainer("T", 0, g, fsdp(0, 1, g))]
    tiles = 4
    box = Box.rows((rows, cols), 0, rows)
    es = [
        engine("E", 0, [
            ("w2_fp8", "float8_e4m3fn", (experts, rows, cols),
             tuple(Piece(source=n, box=box, dst_offset=e * rows * cols, transform=Fp8BlockQuant())
                   for e, n in enumerate(names))),
            ("w2_scale", "float32", (experts, 2, 2),
             tuple(Piece(source=n, box=box, dst_offset=e * tiles * 4, transform=Fp8BlockScale())
                   for e, n in enumerate(names))),
        ])
    ]  # fmt: skip
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=2 * rows * cols))
    rp = _on_gpu(plans["T"].sends[0])
    where = {(op.source, type(op.transform)): b.index for b in rp.buckets for op in b.packs}
    late = [n for n in names if where[(n, Fp8BlockScale)] > where[(n, Fp8BlockQuant)]]
    assert late, where  # the layout this test is about
    regions = {(r.node, r.id): torch.zeros(r.length, dtype=torch.uint8) for r in rp.regions}
    monkeypatch.setattr(directmod, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(Direct, "_region", lambda self, desc, device: regions[(desc.node, desc.id)])
    targets = Direct()._make_all(rp, torch.device("cpu"))
    packed_in: dict[tuple[str, type], int] = {}
    for index, ts_ in targets.items():
        assert ts_, f"bucket {index} has nothing left to pack"
        for _, ops in ts_:
            for op in ops:
                packed_in[(op.source, type(op.transform))] = index
    for n in names:  # every scale with its codes, or earlier: never later than planned
        assert packed_in[(n, Fp8BlockScale)] <= where[(n, Fp8BlockScale)]
    assert any(packed_in[(n, Fp8BlockScale)] == where[(n, Fp8BlockQuant)] for n in late)
    local = {n: g[n].clone() for n in names}
    packer = Packer()
    for b in rp.buckets:
        for region, ops in targets[b.index] or ():
            packer.pack_bucket(ops, local, region)
    want = execute(plans, ts, es, g)
    (got,) = regions.values()
    assert torch.equal(got, want[0])


def test_a_replicated_fp8_tensor_in_place_reaches_every_rank_bitwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One FP8 box written whole to two engine ranks: packed in place, its ops are packed
    into each rank's region, so a bucket holds the same (source, box) twice for codes and
    twice for scales. Each destination gets its bytes (the batch once kept only the last
    destination of a box: one rank's codes and scales were never written)."""
    rows, cols = 256, 384
    gen = torch.Generator().manual_seed(7)
    g = {"w": torch.randn(rows, cols, generator=gen).to(torch.bfloat16)}
    ts = [trainer("T", 0, g, fsdp(0, 1, g))]
    box = Box.rows((rows, cols), 0, rows)

    def dests(r: int) -> list:  # type: ignore[type-arg]
        return [
            ("w_fp8", "float8_e4m3fn", (rows, cols),
             (Piece(source="w", box=box, dst_offset=0, transform=Fp8BlockQuant()),)),
            ("w_scale", "float32", (2, 3),
             (Piece(source="w", box=box, dst_offset=0, transform=Fp8BlockScale()),)),
        ]  # fmt: skip

    es = [engine("E", r, dests(r)) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions())
    want = execute(plans, ts, es, g)
    got, (direct, staged) = _in_place(plans, ts, es, g, monkeypatch)
    assert direct and not staged
    for rank, region in want.items():
        assert region.any() and torch.equal(got[rank], region), f"engine rank {rank}"


def test_a_bucket_into_several_regions_is_packed_as_one_batch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A bucket written to three engine ranks' regions is one target (one BucketPack: one
    launch per kernel, one graph), spanning the regions; still bitwise."""
    seen: list[tuple[int, int]] = []
    one = directmod._one_target

    def counted(targets, device):  # type: ignore[no-untyped-def]
        out = one(targets, device)
        seen.append((len(targets), len(out)))
        return out

    monkeypatch.setattr(directmod, "_one_target", counted)
    g = model()
    ts = [trainer("T", 0, g, fsdp(0, 1, g))]
    es = [engine("E", r, tp_pieces(g, r, 3)) for r in range(3)]
    plans = plan("job", ts, es, PlanOptions())
    want = execute(plans, ts, es, g)
    got, (direct, staged) = _in_place(plans, ts, es, g, monkeypatch)
    assert direct and not staged
    assert max(n for n, _ in seen) == 3 and {m for _, m in seen} == {1}, seen
    for rank, region in want.items():
        assert torch.equal(got[rank], region), f"engine rank {rank}"


def test_buckets_not_all_on_this_gpu_stay_on_staging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = model()
    ts = [trainer("T", r, g, fsdp(r, 2, g)) for r in range(2)]
    es = [engine("E", r, tp_pieces(g, r, 2)) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=1 << 20))
    _, (direct, staged) = _in_place(plans, ts, es, g, monkeypatch, other={1})
    assert staged and not direct  # every bucket also writes to engine rank 1, elsewhere


def test_ops_that_do_not_cover_their_writes_stay_on_staging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = model()
    ts = [trainer("T", 0, g, fsdp(0, 1, g))]
    es = [engine("E", 0, tp_pieces(g, 0, 1))]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=1 << 20))
    monkeypatch.setattr(directmod, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(Direct, "_region", lambda self, desc, device: torch.zeros(desc.length))
    rp = _on_gpu(plans["T"].sends[0])
    bucket = max(rp.buckets, key=lambda b: len(b.packs))
    assert len(bucket.packs) > 1
    assert Direct()._make(rp, bucket, torch.device("cpu")) is not None
    short = msgspec.structs.replace(bucket, packs=bucket.packs[1:])
    assert Direct()._make(rp, short, torch.device("cpu")) is None
    # and never for CPU tensors, delta-capable plans or buckets with delta slots
    assert Direct().targets(rp, bucket, torch.device("cpu")) is None


def test_daemon_refuses_in_place_buckets_that_are_not_colocated() -> None:
    """A rank that says a bucket was packed in place when its writes are not staging to
    GPU memory of its own GPU (here: host memory over tcp) fails that version with a
    TransferError naming the bucket; no immediate is delivered for it, so the engine never
    completes the version; the next version, packed as planned, lands bitwise."""
    from weightwire.client import Engine, Trainer
    from weightwire.harness.localcluster import LocalCluster
    from weightwire.protocol.errors import TransferError

    from .conftest import FAST

    c = LocalCluster(hosts=1, extra=FAST)
    c.start()
    try:
        c.wait_joined()
        sock = c.daemons[0].socket
        w = torch.arange(64 * 48, dtype=torch.float32).view(64, 48)
        got = {"w": torch.zeros_like(w)}
        eng = Engine(0, 1, socket=sock, job="inplace", timeout_s=30)
        eng.register(got)
        tr = Trainer(0, 1, socket=sock, job="inplace", timeout_s=30)
        tr.register({"w": w})
        tr.prepare()
        lie = {"on": True}
        post = Trainer._post_bucket

        def claim(self, poster, index, device, started, delta, in_place=False, queued=False):  # type: ignore[no-untyped-def]
            post(self, poster, index, device, started, delta, in_place or lie["on"], queued)

        Trainer._post_bucket = claim  # type: ignore[method-assign]
        try:
            with pytest.raises(TransferError, match="packed in place"):
                tr.publish(1)
            with pytest.raises(TransferError, match="packed in place"):
                eng.wait(1, 5)
            lie["on"] = False
            w.mul_(-1)
            tr.publish(2)
        finally:
            Trainer._post_bucket = post  # type: ignore[method-assign]
        eng.wait(2, 30)
        assert torch.equal(got["w"].view(torch.uint8), w.view(torch.uint8))
        tr.close()
        eng.close()
    finally:
        assert c.stop() == [0], f"logs in {c.workdir}"
