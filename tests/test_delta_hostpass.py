"""The sender's host pass (client/delta/hostpass.py) on buckets whose writes share or
overlap staging bytes: every payload's changes exact and in stream order, the shadow
moved on, each write's checksum that of its bytes. (The same layouts end to end, through
real daemons: tests/test_delta_tp.py.)"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import xxhash

from weightwire.client.delta import hostpass, scan
from weightwire.client.delta.inplace import InPlace
from weightwire.protocol.plan import Bucket, DeltaSlot, PackOp, WriteOp
from weightwire.protocol.tensors import Box, Cast, Copy

SIZE = 1 << 16


def write(off: int, length: int, rank: int, count: int = 1, stride: int = 0) -> WriteOp:
    return WriteOp(
        src_offset=off, length=length, dst_node="e", dst_region=0, dst_offset=0, slot=rank,
        dst_rank=rank, count=count, src_stride=stride, dst_stride=stride,
    )  # fmt: skip


def slot(rank: int, writes: tuple[int, ...]) -> DeltaSlot:
    return DeltaSlot(
        dst_node="e", dst_rank=rank, slot=rank, dst_region=1, dst_offset=0, capacity=SIZE,
        src_offset=0, writes=writes, width=2,
    )  # fmt: skip


class Planned:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.t[s]


def job(b: Bucket, ds: DeltaSlot) -> hostpass.Job:
    blocks, start = [], 0
    for i in ds.writes:
        wr = b.writes[i]
        for j in range(wr.count):
            blocks.append((wr.src_offset + j * wr.src_stride, wr.length, start, i))
            start += wr.length // 2
    return hostpass.Job(ds, start, scan.Changes(start, 2, start), blocks)


LAYOUTS = {
    # rank 0's write reads block X first; rank 1's stream is [Y, X]: X must not be
    # compared twice, and rank 1's positions must come out in its stream's order
    "shared-block-visited-early": (
        (write(4096, 2048, 0), write(0, 1024, 1), write(4096, 2048, 1)),
        ((0, (0,)), (1, (1, 2))),
    ),
    # rank 0's coalesced write spans bytes rank 1 gets as strided blocks
    "overlapping-blocks": (
        (write(0, 16384, 0), write(512, 256, 1, count=8, stride=2048)),
        ((0, (0,)), (1, (1,))),
    ),
    # one payload whose blocks descend in staging
    "descending-blocks": (
        (write(8192, 4096, 0), write(0, 4096, 0), write(20000, 100, 1)),
        ((0, (0, 1)), (1, (2,))),
    ),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_and_overlapping_blocks(
    layout: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 threads, every segment from 1 KiB up is split between them."""
    monkeypatch.setattr(hostpass, "THREADS", threads)
    monkeypatch.setattr(hostpass, "SPLIT_BYTES", 1024)
    writes, slots = LAYOUTS[layout]
    b = Bucket(index=0, writes=writes, deltas=tuple(slot(r, w) for r, w in slots))
    rng = np.random.default_rng(7)
    old = rng.integers(0, 256, SIZE, dtype=np.uint8)
    new = old.copy()
    hit = rng.random(SIZE // 2) < 0.05
    new.view(np.uint16)[hit] ^= 0x0101
    shadow = old.copy()
    jobs = [job(b, ds) for ds in b.deltas]
    hashers = {i: xxhash.xxh3_64() for i in range(len(writes))}
    hostpass.run(b, Planned(torch.from_numpy(new)), shadow, jobs, hashers)
    covered = np.zeros(SIZE, dtype=bool)
    for wr in writes:
        for k in range(wr.count):
            covered[wr.src_offset + k * wr.src_stride :][: wr.length] = True
    assert np.array_equal(shadow[covered], new[covered])  # moved on where read
    assert np.array_equal(shadow[~covered], old[~covered])  # untouched elsewhere
    for j in jobs:  # the stream's bytes then and now, element by element
        assert not j.dense
        a = np.concatenate([new[off : off + n] for off, n, _, _ in j.blocks]).view(np.uint16)
        o = np.concatenate([old[off : off + n] for off, n, _, _ in j.blocks]).view(np.uint16)
        want = np.flatnonzero(a != o)
        assert np.array_equal(j.changes.positions, want), layout
        assert np.array_equal(j.changes.values.view(np.uint16), a[want])
    for i, wr in enumerate(writes):
        h = xxhash.xxh3_64()
        for k in range(wr.count):
            h.update(new[wr.src_offset + k * wr.src_stride :][: wr.length])
        assert hashers[i].intdigest() == h.intdigest()


def _pack(source: str, offsets: tuple[int, ...], sizes: tuple[int, ...], at: int) -> PackOp:
    n = 2 * int(np.prod(sizes))
    return PackOp(
        source=source, box=Box(offsets=offsets, sizes=sizes), transform=Copy(),
        staging_offset=at, nbytes=n,
    )  # fmt: skip


def test_in_place_reads_the_tensors_and_refuses_what_packing_must_make() -> None:
    t = {"a": torch.arange(64 * 32, dtype=torch.int16).view(torch.bfloat16).view(64, 32)}
    rows = _pack("a", (8, 0), (4, 32), 0)  # 4 whole rows: contiguous
    more = _pack("a", (20, 0), (2, 32), 256)
    b = Bucket(index=0, packs=(rows, more), writes=(write(0, 384, 0),))
    got = InPlace.of(b, t)
    assert got is not None and got.cuts == (0, 256, 384)
    want = torch.cat([t["a"][8:12].reshape(-1), t["a"][20:22].reshape(-1)]).view(torch.uint8)
    assert torch.equal(got[0:384], want)  # across both sources
    assert [(at, p.numel()) for at, p in got.pieces(200, 100)] == [(200, 56), (256, 44)]
    cols = _pack("a", (0, 0), (4, 16), 0)  # half of each row: not contiguous
    assert InPlace.of(Bucket(index=0, packs=(cols,), writes=(write(0, 128, 0),)), t) is None
    gap = Bucket(index=0, packs=(rows,), writes=(write(0, 384, 0),))  # reads unpacked bytes
    assert InPlace.of(gap, t) is None
    param = {"a": torch.nn.Parameter(t["a"], requires_grad=False)}
    assert InPlace.of(b, param) is not None  # parameters are plain tensors too

    class Wrapped(torch.Tensor):  # a tensor subclass (a DTensor, say): packed as before
        pass

    assert InPlace.of(b, {"a": t["a"].as_subclass(Wrapped)}) is None
    cast = msgspec.structs.replace(rows, transform=Cast(dtype="float16"))
    assert InPlace.of(Bucket(index=0, packs=(cast,), writes=(write(0, 256, 0),)), t) is None
