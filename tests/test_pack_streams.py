"""Streams of their own (client/streams.py): a rank's packing stream and the stream its
buckets' CUDA graphs are captured on are never torch's pool streams, so one rank's
capture never takes in another rank's packing (two ranks of one process, one thread
each). GPU only; the CPU has nothing to order."""

from __future__ import annotations

import threading

import pytest
import torch

from weightwire.client import pack as packmod
from weightwire.client.streams import OwnStreams, own_stream
from weightwire.memory.cudadrv import available
from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]


@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
def test_pool_streams_come_round_and_own_streams_do_not() -> None:
    """The premise: torch's `Stream()` is a pool that hands the same CUDA stream out again
    (32 per device and priority); an own stream is none of them, and two differ."""
    dev = torch.device("cuda", 0)
    first = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    pool = {torch.cuda.Stream(dev).cuda_stream for _ in range(64)}  # type: ignore[no-untyped-call]
    assert first.cuda_stream in pool, "torch's stream pool no longer comes round"
    mine, theirs = OwnStreams().get(dev), own_stream(dev)
    assert mine.cuda_stream != theirs.cuda_stream
    more = {torch.cuda.Stream(dev).cuda_stream for _ in range(64)}  # type: ignore[no-untyped-call]
    assert not ({mine.cuda_stream, theirs.cuda_stream} & (pool | more))


def _bucket(tag: int, n: int) -> tuple[tuple[PackOp, ...], dict[str, torch.Tensor], int]:
    """A bucket of a few copies and a cast (a graph is captured on its first run)."""
    g = torch.Generator(device="cuda").manual_seed(tag)
    tensors = {
        f"w{i}": torch.randn((n, 24), generator=g, device="cuda").to(torch.bfloat16)
        for i in range(3)
    }
    tensors["f"] = torch.randn((n, 8), generator=g, device="cuda")
    ops, offset = [], 0
    for name, box, transform, nbytes in [
        *((f"w{i}", Box.full((n, 24)), Copy(), n * 24 * 2) for i in range(3)),
        ("w2", Box.rows((n, 24), 0, 8, dim=1), Copy(), n * 8 * 2),  # strided
        ("f", Box.full((n, 8)), Cast(dtype="bfloat16"), n * 8 * 2),
    ]:
        ops.append(PackOp(source=name, box=box, transform=transform, staging_offset=offset,
                          nbytes=nbytes))  # fmt: skip
        offset = -(-(offset + nbytes) // 16) * 16
    return tuple(ops), tensors, offset


def _want(ops: tuple[PackOp, ...], tensors: dict[str, torch.Tensor], size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device="cuda")
    p = packmod.Packer(graphs=False)
    for op in ops:
        p.pack(op, tensors[op.source], out)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
def test_two_ranks_capture_and_pack_at_once_bitwise() -> None:
    """Two threads, each a rank with its own packing stream (as `Trainer` makes) and its own
    Packer, pack 48 fresh buckets each (a graph captured for every one) at the same time,
    waiting on the caller's stream first as `publish` does. Every capture succeeds and every
    bucket's bytes are bitwise, packed and again replayed: no rank's packs went into the
    other's graph (as they did when both drew streams from torch's pool)."""
    dev = torch.device("cuda", 0)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def rank(r: int) -> None:
        try:
            stream = OwnStreams().get(dev)
            packer = packmod.Packer()
            start.wait(30)
            for k in range(48):
                ops, tensors, size = _bucket(1000 * r + k, 16 + 8 * (k % 5))
                want = _want(ops, tensors, size)
                staging = torch.zeros(size, dtype=torch.uint8, device=dev)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    packer.pack_bucket(ops, tensors, staging)  # eager, then captured
                    stream.synchronize()
                    assert torch.equal(staging, want), f"rank {r} bucket {k}: eager run"
                    (entry,) = (e for e in packer._buckets.values() if e.ops is ops)
                    assert entry.graph is not None, f"rank {r} bucket {k}: no graph"
                    staging.zero_()
                    packer.pack_bucket(ops, tensors, staging)  # the graph replayed
                    stream.synchronize()
                    assert torch.equal(staging, want), f"rank {r} bucket {k}: replay"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
