"""Plan arithmetic past 4 GiB, without allocating: a 12 GiB bf16 tensor held by three
trainer ranks in uneven row shards, cut by columns for two engine ranks (strided writes),
placed after a small tensor so every engine region is over 6 GiB and offsets pass 2^32.
Every engine byte is written exactly once, inside its region; every pack fits its rank's
staging and reads only the box the rank holds. Held."""

from __future__ import annotations

from weightwire.plan.planner import EngineRank, TrainerRank, plan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import Box, DestTensor, Piece, SourceTensor

R, C = 3 * 1024 * 1024 // 2 + 3, 4096  # bf16: 12 GiB and 24 KiB
SHAPE = (R, C)


def test_a_twelve_gib_tensor_is_planned_byte_for_byte() -> None:
    cuts = [0, R // 3 + 7, 2 * R // 3 + 1, R]
    small = SourceTensor(name="b", dtype="float32", shape=(1000,))
    trainers = [
        TrainerRank(
            f"t{i}",
            i,
            (
                SourceTensor(
                    name="w",
                    dtype="bfloat16",
                    shape=SHAPE,
                    box=Box.rows(SHAPE, cuts[i], cuts[i + 1]),
                ),
                *((small,) if i == 0 else ()),
            ),
        )
        for i in range(3)
    ]
    engines, want = [], {}
    for e in range(2):
        lo, hi = e * C // 2, (e + 1) * C // 2
        w = Piece(source="w", box=Box(offsets=(0, lo), sizes=(R, hi - lo)), dst_offset=0)
        b = Piece(source="b", box=Box.full((1000,)), dst_offset=0)
        tensors = (
            DestTensor(
                name="b", dtype="float32", shape=(1000,), region=e + 1, offset=0, pieces=(b,)
            ),
            DestTensor(
                name="w",
                dtype="bfloat16",
                shape=(R, hi - lo),
                region=e + 1,
                offset=4096,
                pieces=(w,),
            ),
        )
        length = 4096 + tensors[1].nbytes
        region = RegionDescriptor(id=e + 1, node=f"e{e}", kind="cpu", length=length)
        engines.append(EngineRank(f"e{e}", e, tensors, (region,)))
        want[e] = (length, [(0, 4000), (4096, tensors[1].nbytes)])
    plans = plan("large", trainers, engines)
    written: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for node in plans:
        for rp in plans[node].sends:
            held = trainers[rp.rank].tensors
            for bucket in rp.buckets:
                for p in bucket.packs:
                    assert p.staging_offset + p.nbytes <= rp.staging_bytes
                    src = next(s for s in held if s.name == p.source)
                    assert p.box.within(src.held().sizes), (p, src)  # in the rank's shard
                for wr in bucket.writes:
                    assert (
                        wr.src_offset + (wr.count - 1) * wr.src_stride + wr.length
                        <= rp.staging_bytes
                    )
                    written[wr.dst_rank] += [
                        (wr.dst_offset + i * wr.dst_stride, wr.length) for i in range(wr.count)
                    ]
    for e, (length, tensors) in want.items():
        spans = sorted(written[e])
        assert max(o + n for o, n in spans) <= length and spans[-1][0] > 1 << 32
        merged: list[tuple[int, int]] = []
        for o, n in spans:
            assert not merged or o >= merged[-1][0] + merged[-1][1], ("overlap", e, o)
            if merged and o == merged[-1][0] + merged[-1][1]:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        assert merged == tensors, (e, merged[:4], tensors)
