"""The planner: every destination byte comes from the right source, bitwise; errors name names."""

from __future__ import annotations

import random

import pytest
import torch

from weightwire.plan.planner import PlanOptions, plan
from weightwire.protocol.errors import PlanError
from weightwire.protocol.tensors import Box, Cast, Piece

from .planlib import check_bitwise, engine, execute, trainer


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "q": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "o": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "norm": torch.randn(16, generator=g),
        "layers.0.mlp.experts.3.w": torch.randn(24, 16, generator=g).to(torch.bfloat16),
    }


def fsdp(rank: int, world: int, g: dict[str, torch.Tensor]) -> dict[str, Box | None]:
    out: dict[str, Box | None] = {}
    for name, t in g.items():
        n = t.shape[0]
        step = -(-n // world)
        lo, hi = min(n, rank * step), min(n, rank * step + step)
        out[name] = Box.rows(tuple(t.shape), lo, hi)
    return out


def tp_pieces(g: dict[str, torch.Tensor], rank: int, tp: int) -> list:
    """Column tensors sliced on dim 0, row tensors on dim 1, the rest whole."""
    dests = []
    for name, t in g.items():
        shape = tuple(t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        if name in ("embed", "q"):
            n = shape[0] // tp if shape[0] % tp == 0 else -(-shape[0] // tp)
            lo, hi = rank * n, min(shape[0], rank * n + n)
            box = Box.rows(shape, lo, hi)
        elif name == "o":
            n = shape[1] // tp
            box = Box.rows(shape, rank * n, rank * n + n, dim=1)
        else:
            box = Box.full(shape)
        dests.append((name, dtype, box.sizes, (Piece(source=name, box=box, dst_offset=0),)))
    return dests


@pytest.mark.parametrize(
    ("trainers", "tp", "replicas"), [(2, 2, 1), (3, 2, 2), (4, 4, 1), (1, 3, 1)]
)
def test_fsdp_to_tp_bitwise(trainers: int, tp: int, replicas: int) -> None:
    g = model()
    ts = [trainer("T", r, g, fsdp(r, trainers, g)) for r in range(trainers)]
    es = [
        engine(f"E{rep}", rep * tp + r, tp_pieces(g, r, tp))
        for rep in range(replicas)
        for r in range(tp)
    ]
    plans = plan("job", ts, es, PlanOptions(bucket_bytes=512, max_write_bytes=300))
    check_bitwise(execute(plans, ts, es, g), es, g)
    writes = [w for p in plans.values() for s in p.sends for b in s.buckets for w in b.writes]
    assert max(w.nbytes for w in writes) <= 300
    for p in plans.values():
        for s in p.sends:
            kinds = [b.kind for b in s.buckets]
            assert kinds == sorted(kinds, key=lambda k: k == "experts"), "dense before experts"


def test_row_sharded_sources_to_whole_destinations() -> None:
    """Megatron row-parallel trainer shards (dim 1) into whole engine tensors: cut per row."""
    g = {"o": torch.randn(6, 8).to(torch.bfloat16)}
    ts = [trainer("T", r, g, {"o": Box.rows((6, 8), 4 * r, 4 * r + 4, dim=1)}) for r in range(2)]
    es = [
        engine(
            "E",
            0,
            [("o", "bfloat16", (6, 8), (Piece(source="o", box=Box.full((6, 8)), dst_offset=0),))],
        )
    ]
    plans = plan("job", ts, es)
    check_bitwise(execute(plans, ts, es, g), es, g)


def test_cast_and_concatenated_pieces() -> None:
    g = {"a": torch.randn(4, 4), "b": torch.randn(2, 4)}
    ts = [trainer("T", 0, g, {"a": None, "b": None})]
    pieces = (
        Piece(
            source="a", box=Box.rows((4, 4), 1, 3), dst_offset=0, transform=Cast(dtype="bfloat16")
        ),
        Piece(source="b", box=Box.full((2, 4)), dst_offset=16, transform=Cast(dtype="bfloat16")),
    )
    es = [engine("E", 0, [("ab", "bfloat16", (4, 4), pieces)])]
    plans = plan("job", ts, es)
    check_bitwise(execute(plans, ts, es, g), es, g)


def test_least_loaded_balances_replicated_sources() -> None:
    g = {f"t{i}": torch.randn(64, 64) for i in range(32)}
    ts = [trainer("T", r, g, {n: None for n in g}) for r in range(4)]
    es = [
        engine(
            f"E{e}",
            e,
            [
                (n, "float32", (64, 64), (Piece(source=n, box=Box.full((64, 64)), dst_offset=0),))
                for n in g
            ],
        )
        for e in range(2)
    ]
    plans = plan("job", ts, es)
    loads = [sum(w.nbytes for b in s.buckets for w in b.writes) for s in plans["T"].sends]
    mean = sum(loads) / len(loads)
    assert max(loads) <= 1.05 * mean, loads
    check_bitwise(execute(plans, ts, es, g), es, g)


def test_plan_is_deterministic_and_its_hash_tracks_layouts() -> None:
    g = model()
    ts = [trainer(f"T{r}", r, g, fsdp(r, 2, g)) for r in range(2)]
    es = [engine("E", r, tp_pieces(g, r, 2)) for r in range(2)]
    a = plan("job", ts, es)
    shuffled_t, shuffled_e = ts[:], es[:]
    random.Random(1).shuffle(shuffled_t)
    random.Random(2).shuffle(shuffled_e)
    b = plan("job", shuffled_t, shuffled_e)
    assert a == b
    es2 = [engine("E", r, tp_pieces(g, r, 2)) for r in range(2)]
    es2[1] = engine("E", 1, tp_pieces(g, 1, 2)[::-1])
    assert plan("job", ts, es2)["E"].plan_hash != a["E"].plan_hash


def errors_of(ts, es, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError) as err:
        plan("job", ts, es, PlanOptions(**kw))
    return err.value.message


def test_errors_list_the_names() -> None:
    g = {"a": torch.randn(4, 4), "b": torch.randn(4, 4)}
    ts = [trainer("T", 0, g, {"a": None, "b": None})]
    full = Box.full((4, 4))
    unknown = engine(
        "E",
        0,
        [
            ("x", "float32", (4, 4), (Piece(source="nope", box=full, dst_offset=0),)),
            ("a", "float32", (4, 4), (Piece(source="a", box=full, dst_offset=0),)),
        ],
    )
    msg = errors_of(ts, [unknown])
    assert "nope" in msg and "source tensors no destination uses: b" in msg
    wrong_dtype = engine(
        "E",
        0,
        [
            ("a", "bfloat16", (4, 4), (Piece(source="a", box=full, dst_offset=0),)),
            ("b", "float32", (4, 4), (Piece(source="b", box=full, dst_offset=0),)),
        ],
    )
    assert "dtype_mismatch" in errors_of(ts, [wrong_dtype])
    gap = engine(
        "E",
        0,
        [
            ("a", "float32", (5, 4), (Piece(source="a", box=full, dst_offset=0),)),
            ("b", "float32", (4, 4), (Piece(source="b", box=full, dst_offset=0),)),
        ],
    )
    assert "pieces give 64 bytes, the tensor has 80" in errors_of(ts, [gap])
    overlap = engine(
        "E",
        0,
        [
            (
                "a",
                "float32",
                (4, 4),
                (
                    Piece(source="a", box=Box.rows((4, 4), 0, 2), dst_offset=0),
                    Piece(source="a", box=Box.rows((4, 4), 2, 4), dst_offset=16),
                ),
            ),
            ("b", "float32", (4, 4), (Piece(source="b", box=full, dst_offset=0),)),
        ],
    )
    assert "overlap" in errors_of(ts, [overlap])
    half = [trainer("T", 0, g, {"a": Box.rows((4, 4), 0, 2), "b": None})]
    both = engine(
        "E",
        0,
        [
            ("a", "float32", (4, 4), (Piece(source="a", box=full, dst_offset=0),)),
            ("b", "float32", (4, 4), (Piece(source="b", box=full, dst_offset=0),)),
        ],
    )
    assert "which no trainer rank holds whole" in errors_of(half, [both])
    disagree = [
        trainer("T", 0, g, {"a": None, "b": None}),
        trainer("T", 1, {"a": torch.randn(4, 5), "b": g["b"]}, {"a": None, "b": None}),
    ]
    assert "disagree on a" in errors_of(disagree, [both])


@pytest.mark.parametrize(("src_lanes", "dst_lanes"), [(1, 1), (2, 2), (4, 2), (2, 8)])
def test_writes_striped_over_lanes_and_counted(src_lanes: int, dst_lanes: int) -> None:
    """Each stripe is a write with its own immediate on its own lane; the destination expects
    every stripe, and the bytes still land bitwise."""
    from dataclasses import replace

    g = {"w": torch.randn(1024, 1024)}  # 4 MiB
    ts = [replace(trainer("T", 0, g, {"w": None}), lanes=src_lanes)]
    es = [
        replace(
            engine(
                "E",
                0,
                [
                    (
                        "w",
                        "float32",
                        (1024, 1024),
                        (Piece(source="w", box=Box.full((1024, 1024)), dst_offset=0),),
                    )
                ],
            ),
            lanes=dst_lanes,
        )
    ]
    plans = plan("job", ts, es, PlanOptions(max_write_bytes=2 << 20, min_stripe_bytes=256 << 10))
    writes = [w for b in plans["T"].sends[0].buckets for w in b.writes]
    stripes = min(src_lanes, dst_lanes)
    assert len(writes) == 2 * stripes
    assert {w.lane for w in writes} == set(range(stripes)) if stripes > 1 else True
    assert all(w.lane < src_lanes for w in writes)
    assert plans["E"].expects[0].count == len(writes)
    check_bitwise(execute(plans, ts, es, g), es, g)


def test_zero_copy_sources_are_written_from_their_region_without_packing() -> None:
    """Tensors declared in a registered region are written from there as they are; only what
    needs transforming (a cast here) or is not contiguous (a dim-1 slice) is packed."""
    from dataclasses import replace

    g = {"a": torch.randn(8, 16), "b": torch.randn(4, 16), "c": torch.randn(16, 8)}
    base = trainer("T", 0, g, {"a": None, "b": None, "c": None})
    import msgspec

    placed = tuple(
        msgspec.structs.replace(s, region=7, offset=off)
        for s, off in zip(base.tensors, (0, 8 * 16 * 4, 12 * 16 * 4), strict=True)
    )
    ts = [replace(base, tensors=placed)]
    es = [
        engine(
            "E",
            0,
            [
                (
                    "a",
                    "float32",
                    (8, 16),
                    (Piece(source="a", box=Box.full((8, 16)), dst_offset=0),),
                ),
                (
                    "b",
                    "bfloat16",
                    (4, 16),
                    (
                        Piece(
                            source="b",
                            box=Box.full((4, 16)),
                            dst_offset=0,
                            transform=Cast(dtype="bfloat16"),
                        ),
                    ),
                ),
                (
                    "c",
                    "float32",
                    (16, 4),
                    (Piece(source="c", box=Box.rows((16, 8), 2, 6, dim=1), dst_offset=0),),
                ),
            ],
        )
    ]
    plans = plan("job", ts, es)
    rp = plans["T"].sends[0]
    packed = {op.source for b in rp.buckets for op in b.packs}
    assert packed == {"b", "c"}, packed
    zero = [w for b in rp.buckets for w in b.writes if w.src_region == 7]
    assert sum(w.nbytes for w in zero) == 8 * 16 * 4
    check_bitwise(execute(plans, ts, es, g), es, g)


def test_one_slice_of_many_experts_is_one_strided_write() -> None:
    """FSDP-2 rows to TP-2 columns of stacked experts: each expert's piece is a block of its
    own at both ends, evenly spaced, so the planner gathers them into strided writes (one
    immediate each, counted); the bytes still land bitwise, none twice."""
    experts, rows, cols = 32, 16, 8
    g = torch.Generator().manual_seed(3)
    model = {
        f"layers.0.mlp.experts.{e}.down": torch.randn(rows, cols, generator=g)
        for e in range(experts)
    }
    ts = [trainer("T", r, model, fsdp(r, 2, model)) for r in range(2)]
    half = cols // 2
    es = [
        engine(
            "E",
            r,
            [
                (
                    "layers.0.mlp.experts.w2",
                    "float32",
                    (experts, rows, half),
                    tuple(
                        Piece(
                            source=f"layers.0.mlp.experts.{e}.down",
                            box=Box.rows((rows, cols), r * half, r * half + half, dim=1),
                            dst_offset=e * rows * half * 4,
                        )
                        for e in range(experts)
                    ),
                )
            ],
        )
        for r in range(2)
    ]
    plans = plan("job", ts, es, PlanOptions(max_write_bytes=4096))
    writes = [w for s in plans["T"].sends for b in s.buckets for w in b.writes]
    block = rows // 2 * half * 4  # one trainer's rows of one expert's slice: 128 bytes
    assert all(w.length == block for w in writes)
    assert sum(w.nbytes for w in writes) == 2 * experts * rows * half * 4
    assert max(w.count for w in writes) == 4096 // block  # capped at max_write_bytes
    assert len(writes) == 2 * 2 * experts * block // 4096  # 2 trainers x 2 engines
    for w in writes:
        assert w.dst_stride == rows * half * 4 and w.src_stride >= w.length
    expects = {x.rank: x.count for x in plans["E"].expects}
    assert expects == {0: len(writes) // 2, 1: len(writes) // 2}
    landed = execute(plans, ts, es, model)
    check_bitwise(landed, es, model)
    covered = [0] * (experts * rows * half * 4)
    for s in plans["T"].sends:
        for w in (w for b in s.buckets for w in b.writes if w.dst_rank == 0):
            for _, do in w.blocks():
                for i in range(do, do + w.length):
                    covered[i] += 1
    assert set(covered) == {1}, "every destination byte written exactly once"


@pytest.mark.parametrize(
    ("tail", "dense", "experts"),
    [
        (4096, [16384] * 3 + [4096] * 4, []),
        (0, [16384] * 4, []),
        (16384, [16384] * 4, []),  # a tail as large as a bucket: off
        (4096, [16384] * 4, [16384] * 3 + [4096] * 4),  # only the send's end, the experts
        (5000, [16384] * 3 + [4992, 3200] * 2, []),  # chunks of whole rows: 39 and 25 of 128 B
    ],
)
def test_a_send_ends_in_tail_buckets(tail: int, dense: list[int], experts: list[int]) -> None:
    """The last bucket_bytes of a trainer rank's send go in buckets of at most tail_bytes
    (chunks cut to fit), the rest as before; bitwise either way."""
    g = {f"layers.{i}.w": torch.randn(64, 64).to(torch.bfloat16) for i in range(8)}  # 8 KiB
    g.update(
        {f"layers.0.mlp.experts.{i}.w": torch.randn(64, 64).to(torch.bfloat16) for i in range(8)}
        if experts
        else {}
    )
    ts = [trainer("T", 0, g, dict.fromkeys(g))]
    es = [engine("E", 0, [d for n in g for d in full_of(n)])]
    options = PlanOptions(bucket_bytes=16384, tail_bytes=tail, max_write_bytes=4096)
    plans = plan("job", ts, es, options)
    buckets = [b for s in plans["T"].sends for b in s.buckets]
    assert [b.nbytes for b in buckets if b.kind == "dense"] == dense
    assert [b.nbytes for b in buckets if b.kind == "experts"] == experts
    assert [b.index for b in buckets] == list(range(len(buckets)))
    check_bitwise(execute(plans, ts, es, g), es, g)


def full_of(name: str) -> list[tuple[str, str, tuple[int, ...], tuple[Piece, ...]]]:
    return [
        (name, "bfloat16", (64, 64), (Piece(source=name, box=Box.full((64, 64)), dst_offset=0),))
    ]
