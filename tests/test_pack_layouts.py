"""Model layouts we did not choose, packed through the trainer's real packing paths and
compared byte for byte with the plain per-op run (`planlib.execute`) and, for FP8, with
`quantize_blocks` of the global box: staging packed a bucket at a time (`Packer.pack_bucket`:
the batched copies, FP8 groups and `rest`), and colocated packing in place (`Direct._make_all`:
ops moved into the engines' regions, FP8 scales hoisted into their codes' bucket, one span
per bucket), a bucket that does not qualify going through staging as it would."""

from __future__ import annotations

import msgspec
import pytest
import torch

from weightwire.client import direct as directmod
from weightwire.client.direct import Direct
from weightwire.client.fp8 import quantize_blocks
from weightwire.client.pack import Packer
from weightwire.plan.planner import EngineRank, PlanOptions, plan
from weightwire.protocol.errors import PlanError
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import Box, Cast, DestTensor, Fp8BlockQuant, Fp8BlockScale, Piece

from .planlib import engine as engine_
from .planlib import execute, slice_of, trainer
from .test_direct import UUID, _on_gpu

Dest = tuple[str, str, tuple[int, ...], tuple[Piece, ...]]


def _apply(bucket, staging, regions, counts, owner) -> None:  # type: ignore[no-untyped-def]
    for w in bucket.writes:
        dst = regions[(w.dst_node, w.dst_region)]
        for so, do in w.blocks():
            dst[do : do + w.length] = staging[so : so + w.length]
        counts[owner[(w.dst_node, w.dst_region)]] += 1


def run(plans, ts, es, g, monkeypatch=None, fail=frozenset(), by_region=False, held=None):  # type: ignore[no-untyped-def]
    """Every trainer rank's buckets through `Packer.pack_bucket` into staging and its writes
    (monkeypatch None), or packed in place where `Direct._make_all` says (regions of
    engine ranks in `fail`, or with (node, region id) in it, cannot be opened); returns each
    engine rank's region bytes (or, `by_region`, each region's). `held(trainer, tensors)`:
    the rank's tensors as it holds them (strided, tied, views of one buffer)."""
    regions = {
        (e.node, r.id): torch.zeros(r.length, dtype=torch.uint8) for e in es for r in e.regions
    }
    owner = {(e.node, r.id): e.rank for e in es for r in e.regions}
    counts = dict.fromkeys(owner.values(), 0)
    if monkeypatch is not None:
        monkeypatch.setattr(directmod, "device_uuid", lambda device: UUID)
        monkeypatch.setattr(
            Direct,
            "_region",
            lambda self, desc, device: (
                None
                if owner[(desc.node, desc.id)] in fail or (desc.node, desc.id) in fail
                else regions[(desc.node, desc.id)]
            ),
        )
    for t in ts:
        local = {s.name: slice_of(g[s.name], s.held()).clone() for s in t.tensors}
        if held is not None:
            local = held(t, local)
        rp = next(s for s in plans[t.node].sends if s.rank == t.rank)
        packer = Packer()
        targets = {}
        if monkeypatch is not None:
            rp = _on_gpu(rp)
            targets = Direct()._make_all(rp, torch.device("cpu"))
        for bucket in rp.buckets:
            there = targets.get(bucket.index)
            if there is None:
                staging = torch.zeros(max(rp.staging_bytes, 1), dtype=torch.uint8)
                packer.pack_bucket(bucket.packs, local, staging)
                _apply(bucket, staging, regions, counts, owner)
                continue
            for region, ops in there:
                packer.pack_bucket(ops, local, region)
            for w in bucket.writes:
                counts[owner[(w.dst_node, w.dst_region)]] += 1
    for e in es:
        expect = next(x for x in plans[e.node].expects if x.rank == e.rank)
        assert expect.count == counts[e.rank], (e.rank, expect.count, counts)
    return regions if by_region else {owner[k]: v for k, v in regions.items()}


def fp8_reference(es, g) -> dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Each engine rank's region built the plain way from the global tensors (copy, cast,
    and quantize_blocks of each piece's box on its own)."""
    out = {}
    for e in es:
        region = torch.zeros(e.regions[0].length, dtype=torch.uint8)
        for d in e.tensors:
            for p in d.pieces or ():
                part = slice_of(g[p.source], p.box)
                if isinstance(p.transform, Fp8BlockQuant):
                    part = quantize_blocks(part.contiguous(), p.transform.block)[0]
                elif isinstance(p.transform, Fp8BlockScale):
                    part = quantize_blocks(part.contiguous(), p.transform.block)[1]
                elif isinstance(p.transform, Cast):
                    part = part.to(getattr(torch, p.transform.dtype))
                raw = part.contiguous().view(torch.uint8).flatten()
                at = d.offset + p.dst_offset
                region[at : at + raw.numel()] = raw
        out[e.rank] = region
    return out


def check_all(plans, ts, es, g, monkeypatch, held=None) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Staging and in place both bitwise as the reference; returns how many buckets went
    in place and how many did not."""
    want = fp8_reference(es, g)
    for name, got in (
        ("execute", execute(plans, ts, es, g)),
        ("staging", run(plans, ts, es, g, held=held)),
        ("in place", run(plans, ts, es, g, monkeypatch, held=held)),
    ):
        for rank, region in want.items():
            assert torch.equal(got[rank], region), f"{name}: engine rank {rank}"
    placed = [
        Direct()._make_all(_on_gpu(s), torch.device("cpu")) for p in plans.values() for s in p.sends
    ]
    n = sum(v is not None for t in placed for v in t.values())
    return n, sum(v is None for t in placed for v in t.values())


def fp8_dests(name: str, shape: tuple[int, ...], box: Box, block: int = 128) -> list[Dest]:
    tiles = (-(-box.sizes[0] // block), -(-box.sizes[1] // block))
    return [
        (f"{name}_fp8", "float8_e4m3fn", tuple(box.sizes),
         (Piece(source=name, box=box, dst_offset=0, transform=Fp8BlockQuant(block=block)),)),
        (f"{name}_scale", "float32", tiles,
         (Piece(source=name, box=box, dst_offset=0, transform=Fp8BlockScale(block=block)),)),
    ]  # fmt: skip


def rows_of(shape: tuple[int, ...], rank: int, world: int, align: int = 1) -> Box:
    per = -(-shape[0] // world)
    step = -(-per // align) * align
    lo = min(shape[0], rank * step)
    return Box.rows(shape, lo, min(shape[0], lo + step))


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _replicated(ranks: int, replicas: int, fp8: bool, shape: tuple[int, int]):  # type: ignore[no-untyped-def]
    g = {"w": randn(*shape, seed=1), "b": randn(shape[1], seed=2)}
    ts = [trainer("T", 0, g, {n: Box.full(tuple(t.shape)) for n, t in g.items()})]
    full = Box.full(shape)
    dests: list[Dest] = [
        (
            "b",
            "bfloat16",
            (shape[1],),
            (Piece(source="b", box=Box.full((shape[1],)), dst_offset=0),),
        )
    ]
    dests += (
        fp8_dests("w", shape, full)
        if fp8
        else [("w", "bfloat16", shape, (Piece(source="w", box=full, dst_offset=0),))]
    )
    es = [
        engine_(f"E{rep}", rep * ranks + r, dests) for rep in range(replicas) for r in range(ranks)
    ]
    return g, ts, es


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("ranks", "replicas"), [(2, 1), (4, 1), (2, 2), (1, 3)])
@pytest.mark.parametrize("bucket", [1 << 20, 4096])
def test_replicated_tensors_to_ranks_and_replicas(
    ranks, replicas, fp8, bucket, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    g, ts, es = _replicated(ranks, replicas, fp8, (200, 130))
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=3000))
    direct, _ = check_all(plans, ts, es, g, monkeypatch)
    assert direct


@pytest.mark.parametrize(
    ("shape", "trainers", "tp"),
    [
        ((300, 260), 2, 2),
        ((1, 200), 1, 2),
        ((200, 1), 2, 1),
        ((130, 3), 2, 3),
        ((130, 129), 3, 3),
        ((256, 384), 2, 3),
    ],
)
@pytest.mark.parametrize("bucket", [1 << 20, 2500])
def test_fp8_fsdp_rows_to_tp_columns(shape, trainers, tp, bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """FSDP row shards (whole 128-row tiles for the FP8 source, any rows for the cast one)
    to TP column slices (partial tiles at the slice's end), sizes off 128, 1-row and
    1-column tensors, buckets that cut a box's codes from its scales, writes cut at
    max_write_bytes."""
    g = {"w": randn(*shape, seed=3), "x": randn(*shape, seed=4, dtype=torch.float32)}
    ts = [
        trainer(
            "T", r, g, {"w": rows_of(shape, r, trainers, 128), "x": rows_of(shape, r, trainers)}
        )
        for r in range(trainers)
    ]
    step = -(-shape[1] // tp)

    def dests(r: int) -> list[Dest]:
        lo, hi = min(shape[1], r * step), min(shape[1], r * step + step)
        box = Box.rows(shape, lo, hi, dim=1)
        cast = (Piece(source="x", box=box, dst_offset=0, transform=Cast(dtype="bfloat16")),)
        return [*fp8_dests("w", shape, box), ("x", "bfloat16", tuple(box.sizes), cast)]

    es = [engine_("E", r, dests(r)) for r in range(tp)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=700))
    direct, _ = check_all(plans, ts, es, g, monkeypatch)
    assert direct


def test_an_fp8_tile_split_between_trainer_ranks_is_a_plan_error() -> None:
    g = {"w": randn(300, 260)}
    ts = [trainer("T", r, g, {"w": rows_of((300, 260), r, 2)}) for r in range(2)]
    es = [engine_("E", 0, fp8_dests("w", (300, 260), Box.full((300, 260))))]
    with pytest.raises(PlanError, match="w_fp8: FP8 block quantization of w needs whole"):
        plan("job", ts, es, PlanOptions())


def test_scales_hoisted_into_a_bucket_that_cannot_go_in_place_still_land(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An engine rank whose FP8 codes and scales are separate regions (separate allocations),
    the codes' region one this process cannot open (its buckets go through staging): the
    scales, in a later bucket packed in place, must not be hoisted into the codes' bucket,
    which packs its planned ops into staging and never the hoisted ones."""
    shape = (256, 256)
    g = {"w": randn(*shape, seed=1), "a": randn(64, 64, seed=2)}
    ts = [trainer("T", 0, g, {n: Box.full(tuple(t.shape)) for n, t in g.items()})]
    (codes, codes_piece), (scales, scale_piece) = [
        (d, d[3]) for d in fp8_dests("w", shape, Box.full(shape))
    ]
    tensors = (
        DestTensor(name=codes[0], dtype=codes[1], shape=codes[2], region=1, offset=0,
                   pieces=codes_piece),
        DestTensor(name=scales[0], dtype=scales[1], shape=scales[2], region=2, offset=0,
                   pieces=scale_piece),
        DestTensor(name="a", dtype="bfloat16", shape=(64, 64), region=2, offset=64,
                   pieces=(Piece(source="a", box=Box.full((64, 64)), dst_offset=0),)),
    )  # fmt: skip
    regions = (
        RegionDescriptor(id=1, node="E", kind="cpu", length=256 * 256),
        RegionDescriptor(id=2, node="E", kind="cpu", length=64 + 64 * 64 * 2),
    )
    es = [EngineRank("E", 0, tensors, regions)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=256 * 256))
    rp = plans["T"].sends[0]
    where = {(op.source, type(op.transform)): b.index for b in rp.buckets for op in b.packs}
    assert where[("w", Fp8BlockScale)] > where[("w", Fp8BlockQuant)]  # the layout at issue
    want = run(plans, ts, es, g, by_region=True)
    got = run(plans, ts, es, g, monkeypatch, fail={("E", 1)}, by_region=True)
    codes_, scales_ = quantize_blocks(g["w"])
    assert torch.equal(want[("E", 1)], codes_.view(torch.uint8).flatten())
    assert torch.equal(want[("E", 2)][:16], scales_.view(torch.uint8).flatten())
    for region, bytes_ in want.items():
        assert torch.equal(got[region], bytes_), f"region {region}"


def _strided(t, local):  # type: ignore[no-untyped-def]
    """Every 2-D tensor held transposed in memory (column-major), same values."""
    return {n: v.T.contiguous().T if v.dim() == 2 else v for n, v in local.items()}


def _tied(t, local):  # type: ignore[no-untyped-def]
    """'w2' the very tensor object 'w' is (tied embeddings)."""
    return {**local, "w2": local["w"]}


def _overlapping(t, local):  # type: ignore[no-untyped-def]
    """'w' and 'w2' views of one buffer that overlap (w2 = rows 64.. of w's buffer)."""
    buf = torch.cat([local["w"], local["w2"][-64:]])
    return {**local, "w": buf[: local["w"].shape[0]], "w2": buf[64:]}


@pytest.mark.parametrize("held", [None, _strided, _tied, _overlapping])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("bucket", [1 << 20, 3000])
def test_trainer_tensors_held_strided_tied_or_overlapping(held, fp8, bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Trainer tensors as models hold them: transposed in memory, tied under two names, or
    overlapping views of one buffer; each packed to two engine ranks (w whole to both,
    w2 by columns), and an engine rank receiving the same piece under two names."""
    shape = (200, 136)
    w = randn(*shape, seed=5)
    w2 = w.clone() if held is _tied else torch.cat([w[64:], randn(64, 136, seed=6)])
    g = {"w": w, "w2": w2}
    ts = [trainer("T", 0, g, {n: Box.full(shape) for n in g})]

    def dests(r: int) -> list[Dest]:
        cols = Box.rows(shape, r * 68, r * 68 + 68, dim=1)
        if fp8:
            return [*fp8_dests("w", shape, Box.full(shape)), *fp8_dests("w2", shape, cols)]
        whole = (Piece(source="w", box=Box.full(shape), dst_offset=0),)
        return [
            ("w", "bfloat16", shape, whole),
            ("w_tied", "bfloat16", shape, whole),
            ("w2", "float16", (200, 68),
             (Piece(source="w2", box=cols, dst_offset=0, transform=Cast(dtype="float16")),)),
        ]  # fmt: skip

    es = [engine_("E", r, dests(r)) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=5000))
    direct, _ = check_all(plans, ts, es, g, monkeypatch, held=held)
    assert direct or not fp8  # one block to two places of a region (w_tied): staging


def _merged_rows(t, local):  # type: ignore[no-untyped-def]
    """'w' held as Megatron holds a QKV part: (groups, rows per group, cols), a view that
    steps over the other heads of each group."""
    w = local["w"]
    qkv = torch.randn(4, w.shape[0] // 4 + 24, w.shape[1]).to(w.dtype)
    qkv[:, : w.shape[0] // 4] = w.view(4, -1, w.shape[1])
    return {**local, "w": qkv[:, : w.shape[0] // 4]}


@pytest.mark.parametrize("rows", [(0, 256), (64, 200), (100, 101)])
@pytest.mark.parametrize("fp8", [False, True])
def test_merged_rows_sources_by_row_slices(rows, fp8, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A merged-rows (Megatron QKV) source packed by row slices that start or end inside a
    group, whole, copied, cast and FP8 (the FP8 ones through `rest`), to two ranks."""
    shape = (256, 136)
    g = {"w": randn(*shape, seed=8)}
    ts = [trainer("T", 0, g, {"w": Box.full(shape)})]
    box = Box.rows(shape, *rows)
    if fp8:
        dests = fp8_dests("w", shape, box)
    else:
        cast = Piece(source="w", box=box, dst_offset=0, transform=Cast(dtype="float32"))
        dests = [
            ("w", "bfloat16", tuple(box.sizes), (Piece(source="w", box=box, dst_offset=0),)),
            ("w32", "float32", tuple(box.sizes), (cast,)),
        ]
    es = [engine_("E", r, dests) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions(max_write_bytes=4000))
    direct, _ = check_all(plans, ts, es, g, monkeypatch, held=_merged_rows)
    assert direct


@pytest.mark.parametrize("fp8", [False, True])
def test_zero_size_tensors(fp8, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = {"z": randn(0, 256, seed=9), "w": randn(8, 8, seed=10)}
    ts = [trainer("T", 0, g, {n: Box.full(tuple(t.shape)) for n, t in g.items()})]
    w = ("w", "bfloat16", (8, 8), (Piece(source="w", box=Box.full((8, 8)), dst_offset=0),))
    z = Box.full((0, 256))
    dests = (
        fp8_dests("z", (0, 256), z)
        if fp8
        else [("z", "bfloat16", (0, 256), (Piece(source="z", box=z, dst_offset=0),))]
    )
    es = [engine_("E", r, [*dests, w]) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions())
    check_all(plans, ts, es, g, monkeypatch)


def test_fp8_codes_of_another_fp8_dtype_are_a_plan_error() -> None:
    """The packers make float8_e4m3fn codes only: an engine asking for e5m2 codes is told so
    at planning (it was planned, and got e4m3fn bits read as e5m2: NaNs and garbage)."""
    g = {"w": randn(128, 128)}
    ts = [trainer("T", 0, g, {"w": Box.full((128, 128))})]
    quant = Fp8BlockQuant(dtype="float8_e5m2")
    piece = Piece(source="w", box=Box.full((128, 128)), dst_offset=0, transform=quant)
    es = [engine_("E", 0, [("w_fp8", "float8_e5m2", (128, 128), (piece,))])]
    with pytest.raises(PlanError, match=r"w_fp8: FP8 block quantization of w to float8_e5m2"):
        plan("job", ts, es, PlanOptions())


@pytest.mark.parametrize("bucket", [1 << 20, 5000])
def test_one_box_under_every_recipe_in_one_bucket(bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The same box of one source to engine ranks that each want it differently (FP8 at
    block 128 and at block 64, bf16, fp32), two replicas of them, and one rank that wants
    the codes at both block sizes: no recipe's bytes stand in for another's."""
    shape = (160, 200)
    g = {"w": randn(*shape, seed=11)}
    ts = [trainer("T", 0, g, {"w": Box.full(shape)})]
    full = Box.full(shape)
    wants: list[list[Dest]] = [
        fp8_dests("w", shape, full),
        fp8_dests("w", shape, full, block=64),
        [("w", "bfloat16", shape, (Piece(source="w", box=full, dst_offset=0),))],
        [("w", "float32", shape,
          (Piece(source="w", box=full, dst_offset=0, transform=Cast(dtype="float32")),))],
        [*fp8_dests("w", shape, full, block=64), *[
            (f"b{n}", t, s, p) for n, t, s, p in fp8_dests("w", shape, full)]],
    ]  # fmt: skip
    es = [
        engine_(f"E{rep}", rep * len(wants) + r, d) for rep in range(2) for r, d in enumerate(wants)
    ]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=4096))
    direct, _ = check_all(plans, ts, es, g, monkeypatch)
    assert direct


@pytest.mark.parametrize("trainers", [2, 3])
@pytest.mark.parametrize("bucket", [1 << 20, 9000])
def test_sources_every_trainer_rank_holds_whole(trainers, bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Sources replicated on the trainer side (every rank holds them whole), to FP8, bf16
    and cast destinations on three engine ranks: however the planner shares the boxes and
    their tiles between trainer ranks, every byte is bitwise."""
    shape = (400, 272)
    g = {"w": randn(*shape, seed=12), "v": randn(*shape, seed=13, dtype=torch.float32)}
    ts = [trainer("T", r, g, {n: Box.full(shape) for n in g}) for r in range(trainers)]

    def dests(r: int) -> list[Dest]:
        cols = Box.rows(shape, r * 136 // 2, r * 136 // 2 + 136, dim=1)
        cast = Piece(source="v", box=cols, dst_offset=0, transform=Cast(dtype="bfloat16"))
        return [*fp8_dests("w", shape, cols), ("v", "bfloat16", tuple(cols.sizes), (cast,))]

    es = [engine_("E", r, dests(r)) for r in range(3)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=6000))
    sending = [s.rank for p in plans.values() for s in p.sends if s.buckets]
    assert len(sending) > 1, sending  # the boxes are shared out
    direct, _ = check_all(plans, ts, es, g, monkeypatch)
    assert direct


@pytest.mark.parametrize("bucket", [1 << 20, 40000])
def test_fp8_of_a_stacked_3d_source(bucket, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Stacked experts as one 3-D source (tiles on the last two dims), FP8 by column
    halves to two ranks, cut between experts by small buckets and writes (through `rest`)."""
    shape = (6, 136, 200)
    g = {"experts": randn(*shape, seed=14)}
    ts = [trainer("T", 0, g, {"experts": Box.full(shape)})]

    def dests(r: int) -> list[Dest]:
        box = Box.rows(shape, r * 100, r * 100 + 100, dim=2)
        tiles = (6, 2, 1)
        return [
            ("w_fp8", "float8_e4m3fn", (6, 136, 100),
             (Piece(source="experts", box=box, dst_offset=0, transform=Fp8BlockQuant()),)),
            ("w_scale", "float32", tiles,
             (Piece(source="experts", box=box, dst_offset=0, transform=Fp8BlockScale()),)),
        ]  # fmt: skip

    es = [engine_("E", r, dests(r)) for r in range(2)]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=bucket, max_write_bytes=30000))
    direct, _ = check_all(plans, ts, es, g, monkeypatch)
    assert direct


def test_an_engine_back_in_new_memory_under_the_same_plan_hash_is_packed_there(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """A plan of the same hash with other regions (an elastic trainer plan's hash is its
    packs', the same whichever replicas are live; a hash never covers keys): here the
    engine's region behind a new IPC handle. Packing in place goes to the new memory (it
    went on into the old mapping: the engine got its immediates and none of the bytes)."""

    shape = (128, 136)
    g = {"w": randn(*shape, seed=15)}
    ts = [trainer("T", 0, g, {"w": Box.full(shape)})]
    whole = (Piece(source="w", box=Box.full(shape), dst_offset=0),)
    es = [
        engine_("E", 0, [*fp8_dests("w", shape, Box.full(shape)), ("w", "bfloat16", shape, whole)])
    ]
    want = fp8_reference(es, g)[0]
    old, new = torch.zeros_like(want), torch.zeros_like(want)
    monkeypatch.setitem(directmod.EXPORTED, b"\1" * 64, old.data_ptr())
    monkeypatch.setitem(directmod.EXPORTED, b"\2" * 64, new.data_ptr())
    _host_memory_as_gpu(monkeypatch)
    d, packer, local = Direct(), Packer(), {"w": g["w"].clone()}
    plans = []
    for handle in (b"\1" * 64, b"\2" * 64):
        rp = _behind(
            _on_gpu(plan("job", ts, es, PlanOptions(bucket_bytes=9000))["T"].sends[0]), handle
        )
        plans.append(rp)
        for bucket in rp.buckets:
            targets = d.targets(rp, bucket, torch.device("cuda", 0))
            assert targets is not None
            for region, ops in targets:
                packer.pack_bucket(ops, local, region)
    assert plans[0].plan_hash == plans[1].plan_hash
    assert torch.equal(old, want)
    assert torch.equal(new, want), "the restarted engine's memory"


def _host_memory_as_gpu(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Direct's regions on this host: any device is this one, an address is host bytes."""
    import ctypes

    monkeypatch.setattr(directmod, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(
        directmod,
        "_span",
        lambda ptr, n, device: torch.frombuffer(
            (ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8
        ),
    )


def _behind(rp, handle: bytes):  # type: ignore[no-untyped-def]
    """rp with every region behind the IPC handle `handle`."""
    return msgspec.structs.replace(
        rp,
        regions=tuple(
            msgspec.structs.replace(
                r, keys=msgspec.structs.replace(
                    r.keys, cuda=msgspec.structs.replace(r.keys.cuda, ipc_handle=handle)))
            for r in rp.regions
        ),
    )  # fmt: skip


def test_mappings_of_engine_memory_no_longer_planned_are_closed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An engine back in new memory (or gone): the old handle's mapping is closed once the
    device has finished what was queued (it kept the old memory allocated on the GPU, one
    more mapping per engine restart); the mapping still planned stays open."""

    shape = (64, 64)
    g = {"w": randn(*shape, seed=16)}
    ts = [trainer("T", 0, g, {"w": Box.full(shape)})]
    whole = (Piece(source="w", box=Box.full(shape), dst_offset=0),)
    es = [engine_("E", 0, [("w", "bfloat16", shape, whole)])]
    memory = {
        h: torch.zeros(shape[0] * shape[1] * 2, dtype=torch.uint8) for h in (b"\1" * 64, b"\2" * 64)
    }
    events: list[tuple[str, object]] = []

    class Driver:
        def use(self, ordinal: int) -> None:
            pass

        def ipc_open(self, handle: bytes) -> int:
            events.append(("open", handle))
            return memory[handle].data_ptr()

        def ipc_close(self, ptr: int) -> None:
            events.append(("close", ptr))

    monkeypatch.setattr(directmod, "driver", Driver)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: events.append(("sync", device))
    )
    _host_memory_as_gpu(monkeypatch)
    d, packer, local, dev = Direct(), Packer(), {"w": g["w"].clone()}, torch.device("cuda", 0)
    base = _on_gpu(plan("job", ts, es, PlanOptions(bucket_bytes=4096))["T"].sends[0])
    for handle in (b"\1" * 64, b"\1" * 64, b"\2" * 64):
        rp = _behind(base, handle)
        for bucket in rp.buckets:
            for region, ops in d.targets(rp, bucket, dev) or ():
                packer.pack_bucket(ops, local, region)
    old, new = memory[b"\1" * 64].data_ptr(), memory[b"\2" * 64]
    assert events == [
        ("open", b"\1" * 64),
        ("sync", dev),
        ("close", old),
        ("open", b"\2" * 64),
    ], "opened once, closed once the plan moved on, after a synchronize"
    assert torch.equal(new.view(torch.bfloat16).view(shape), g["w"])
    d.close()
    assert events[-1] == ("close", new.data_ptr())
