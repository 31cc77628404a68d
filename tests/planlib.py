"""Helpers to run a plan without any daemon: pack with the client's code, apply the writes,
and compare with a reference built directly from the global tensors."""

from __future__ import annotations

import torch

from weightwire.client.dtypes import TORCH
from weightwire.client.pack import pack
from weightwire.plan.planner import EngineRank, TrainerRank
from weightwire.protocol.plan import NodePlan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import Box, DestTensor, Piece, SourceTensor


def slice_of(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


def trainer(
    node: str, rank: int, globals_: dict[str, torch.Tensor], boxes: dict[str, Box | None]
) -> TrainerRank:
    from weightwire.client.dtypes import name_of

    return TrainerRank(
        node,
        rank,
        tuple(
            SourceTensor(
                name=n, dtype=name_of(globals_[n].dtype), shape=tuple(globals_[n].shape), box=b
            )
            for n, b in boxes.items()
        ),
    )


def engine(
    node: str, rank: int, dests: list[tuple[str, str, tuple[int, ...], tuple[Piece, ...]]]
) -> EngineRank:
    """dests: (name, dtype, shape, pieces), one after another in the rank's region (id rank+1)."""
    tensors, offset = [], 0
    for name, dtype, shape, pieces in dests:
        t = DestTensor(
            name=name, dtype=dtype, shape=shape, region=rank + 1, offset=offset, pieces=pieces
        )
        tensors.append(t)
        offset += -(-t.nbytes // 64) * 64
    region = RegionDescriptor(id=rank + 1, node=node, kind="cpu", length=max(offset, 1))
    return EngineRank(node, rank, tuple(tensors), (region,))


def execute(
    plans: dict[str, NodePlan],
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    globals_: dict[str, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Run every rank's packs and writes; returns each engine rank's region bytes."""
    regions = {
        (e.node, r.id): torch.zeros(r.length, dtype=torch.uint8) for e in engines for r in e.regions
    }
    owner = {(e.node, r.id): e.rank for e in engines for r in e.regions}
    counts: dict[int, int] = {}
    for t in trainers:
        local = {s.name: slice_of(globals_[s.name], s.held()).clone() for s in t.tensors}
        held = _source_regions(t, local)
        rp = next(s for s in plans[t.node].sends if s.rank == t.rank)
        staging = torch.zeros(max(rp.staging_bytes, 1), dtype=torch.uint8)
        for bucket in rp.buckets:
            for op in bucket.packs:
                pack(op, local[op.source], staging)
            for w in bucket.writes:
                dst = regions[(w.dst_node, w.dst_region)]
                src = staging if w.src_region < 0 else held[w.src_region]
                for so, do in w.blocks():
                    dst[do : do + w.length] = src[so : so + w.length]
                counts[owner[(w.dst_node, w.dst_region)]] = (
                    counts.get(owner[(w.dst_node, w.dst_region)], 0) + 1
                )
    for e in engines:
        expect = next(x for x in plans[e.node].expects if x.rank == e.rank)
        assert expect.count == counts.get(e.rank, 0), (e.rank, expect.count, counts)
    return {owner[k]: v for k, v in regions.items()}


def _source_regions(t: TrainerRank, local: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The rank's registered regions, holding its zero-copy tensors at their offsets."""
    sizes: dict[int, int] = {}
    for s in t.tensors:
        if s.region >= 0:
            end = s.offset + local[s.name].numel() * local[s.name].element_size()
            sizes[s.region] = max(sizes.get(s.region, 0), end)
    out = {r: torch.zeros(n, dtype=torch.uint8) for r, n in sizes.items()}
    for s in t.tensors:
        if s.region >= 0:
            raw = local[s.name].contiguous().view(torch.uint8).flatten()
            out[s.region][s.offset : s.offset + raw.numel()] = raw
    return out


def reference(dst: DestTensor, globals_: dict[str, torch.Tensor]) -> torch.Tensor:
    """The destination tensor's bytes, built the plain way (copy and cast only)."""
    from weightwire.protocol.tensors import Cast, Copy

    out = torch.zeros(dst.nbytes, dtype=torch.uint8)
    assert dst.pieces is not None
    for p in dst.pieces:
        part = slice_of(globals_[p.source], p.box).contiguous()
        if isinstance(p.transform, Cast):
            part = part.to(TORCH[p.transform.dtype])
        else:
            assert isinstance(p.transform, Copy)
        raw = part.view(torch.uint8).flatten()
        out[p.dst_offset : p.dst_offset + raw.numel()] = raw
    return out


def check_bitwise(
    regions: dict[int, torch.Tensor], engines: list[EngineRank], globals_: dict[str, torch.Tensor]
) -> None:
    for e in engines:
        for d in e.tensors:
            got = regions[e.rank][d.offset : d.offset + d.nbytes]
            assert torch.equal(got, reference(d, globals_)), f"engine {e.rank}: {d.name} differs"
