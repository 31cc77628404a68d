"""The engine's compiled host apply (client/delta/hostapply.py, decodeloop.block16_starts
and scatter): a BLOCK16 payload written into registered host tensors, bit for bit what
the reference (positions decoded, then `codec.scatter`) writes, and each range's
checksum taken while writing equal to xxh3 of the range afterwards; ranges over several
tensors, strided, misaligned pieces, a range written twice; a malformed body refused
before any byte is written."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from weightwire.client.delta import codec, decodeloop, hostapply
from weightwire.client.delta.codec import BLOCK, Kind
from weightwire.client.delta.receiver import DeltaReceiver, Target

pytestmark = pytest.mark.skipif(not decodeloop.compiled(), reason="numba is not installed")
DT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _receiver(sizes: list[int], gap: int = 0) -> tuple[DeltaReceiver, torch.Tensor]:
    """Region 0 made of tensors of `sizes` bytes, back to back (`gap` bytes of padding at
    the start of the backing buffer, so that pieces can be misaligned)."""
    total = sum(sizes)
    backing = torch.zeros(total + gap + 8, dtype=torch.uint8)
    rx = DeltaReceiver(0, torch.zeros(8, dtype=torch.uint8))
    at, targets = 0, []
    for size in sizes:
        targets.append(Target(0, at, size, backing[gap + at : gap + at + size]))
        at += size
    rx.add_targets(targets)
    return rx, backing[gap : gap + total]


def _stream(rx: DeltaReceiver, blocks: tuple) -> torch.Tensor:  # type: ignore[type-arg]
    parts = []
    for region, offset, length, count, stride in blocks:
        for i in range(count):
            parts += [p.clone() for p in rx.pieces(region, offset + i * stride, length)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _case(width: int, sizes: list[int], blocks: tuple, density: float, gap: int = 0, seed: int = 0):  # type: ignore[no-untyped-def,type-arg]
    rx, region = _receiver(sizes, gap)
    rng = np.random.default_rng(seed)
    region.copy_(torch.from_numpy(rng.integers(0, 256, region.numel(), dtype=np.uint8)))
    old = _stream(rx, blocks)
    n = old.numel() // width
    hit = np.flatnonzero(rng.random(n) < density)
    new = old.clone()
    flips = rng.integers(1, 256, (hit.size, width), dtype=np.uint8)
    new.numpy()[: n * width].reshape(n, width)[hit] ^= flips
    pos = torch.from_numpy(hit.astype(np.int64))
    body = codec.encode_body(pos, codec.values_at(new, pos, width), n, width, Kind.BLOCK16)
    return rx, region, old, new, body, n, hit.size


def _digest_after(rx: DeltaReceiver, r: tuple) -> int:  # type: ignore[type-arg]
    h = xxhash.xxh3_64()
    region, offset, length, count, stride = r
    for i in range(count):
        for p in rx.pieces(region, offset + i * stride, length):
            h.update(p.numpy())
    return h.intdigest()


LAYOUTS = {
    # two tensors, one range each
    "two-ranges": (2, [3 << 20, 1 << 20], ((0, 0, 3 << 20, 1, 0), (0, 3 << 20, 1 << 20, 1, 0))),
    # one range spanning three tensors of ragged sizes
    "spanning": (2, [1002, 70000, 131074], ((0, 0, 202076, 1, 0),)),
    # strided blocks (count > 1) and a width of 4
    "strided": (4, [1 << 20], ((0, 64, 4096, 100, 8192), (0, 900000, 4000, 1, 0))),
    # bytes and 8-byte elements
    "fp8": (1, [200001], ((0, 1, 200000, 1, 0),)),
    "wide": (8, [1 << 19], ((0, 8, 65536 * 8 - 16, 1, 0),)),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as p:
        yield p


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("density", [0.0, 0.042, 0.5])
@pytest.mark.parametrize("gap", [0, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_apply_matches_reference_and_hashes_each_range(
    layout: str, density: float, gap: int, threads: int, pool: ThreadPoolExecutor
) -> None:
    """Applied on one thread, or the blocks on two at once (a version's end)."""
    width, sizes, blocks = LAYOUTS[layout]
    rx, _, _, new, body, n, k = _case(width, sizes, blocks, density, gap, seed=len(layout))
    ranges = set(blocks)
    on = pool if threads == 2 else None
    got = hostapply.block16(body.numpy(), n, k, width, blocks, rx.pieces, ranges, on)
    assert torch.equal(_stream(rx, blocks), new)
    assert got == {r: _digest_after(rx, r) for r in blocks}


def test_a_range_written_twice_or_not_asked_for_is_not_hashed() -> None:
    width, sizes = 2, [1 << 16]
    r = (0, 0, 1 << 15, 1, 0)
    other = (0, 1 << 15, 1 << 15, 1, 0)
    blocks = (r, r, other)
    rx, _, _, _, body, n, k = _case(width, sizes, blocks, 0.0)
    got = hostapply.block16(body.numpy(), n, k, width, blocks, rx.pieces, {r})
    assert got == {}  # r is written twice; `other` was not asked for


def test_chunks_cut_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that cut blocks of the stream and elements' runs at odd places."""
    monkeypatch.setattr(hostapply, "CHUNK", 4098)
    width, sizes, blocks = LAYOUTS["spanning"]
    rx, _, _, new, body, n, k = _case(width, sizes, blocks, 0.3, seed=5)
    got = hostapply.block16(body.numpy(), n, k, width, blocks, rx.pieces, set(blocks))
    assert torch.equal(_stream(rx, blocks), new)
    assert got == {blocks[0]: _digest_after(rx, blocks[0])}


def _corrupt(body: np.ndarray, n: int, k: int, how: str) -> None:
    nb = -(-n // BLOCK)
    counts = body[: 4 * nb].view(np.uint32)
    low = body[4 * nb : 4 * nb + 2 * k].view(np.uint16)
    match how:
        case "counts":
            counts[0] += 1
            counts[1] -= 1 if counts[1] else 0
            if int(counts.sum()) == k:
                counts[-1] += 1
        case "order":
            low[1], low[2] = low[2], low[1]
        case "repeat":
            low[2] = low[1]
        case "range":
            assert counts[-1] > 0 and n % BLOCK < 0xFFFF
            low[-1] = 0xFFFF  # the last change, still increasing, past n in the last block


@pytest.mark.parametrize("how", ["counts", "order", "repeat", "range"])
def test_a_malformed_body_is_refused_before_any_write(how: str) -> None:
    width, sizes = 2, [3 * BLOCK * 2 + 100]
    blocks = ((0, 0, 2 * (2 * BLOCK + 5000), 1, 0),)
    rx, region, _, _, body, n, k = _case(width, sizes, blocks, 0.05, seed=3)
    raw = body.numpy().copy()
    _corrupt(raw, n, k, how)
    before = region.clone()
    with pytest.raises(ValueError, match=r"BLOCK16 counts|out of range or not increasing"):
        hostapply.block16(raw, n, k, width, blocks, rx.pieces, set(blocks))
    assert torch.equal(region, before)
    with pytest.raises(ValueError):  # the reference decode refuses it too
        codec.decode(Kind.BLOCK16, torch.from_numpy(raw), n, k, width)


def test_body_size_is_checked() -> None:
    width, sizes, blocks = LAYOUTS["fp8"]
    rx, _, _, _, body, n, k = _case(width, sizes, blocks, 0.1)
    with pytest.raises(ValueError, match="expected"):
        hostapply.block16(body.numpy()[:-1], n, k, width, blocks, rx.pieces, set())


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_scatter_edges(width: int) -> None:
    """Every [s, e) window of a stream with changes at and around block edges."""
    n = 3 * BLOCK + 7
    pos = np.array(
        [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK + 3, n - 1], np.int64
    )
    vals = (np.arange(pos.size) + 1).astype(DT[width])
    counts = np.bincount(pos >> 16, minlength=-(-n // BLOCK)).astype(np.uint32)
    low = (pos & 0xFFFF).astype(np.uint16)
    starts = decodeloop.block16_starts(counts, low, n)
    edges = sorted({0, n, *(int(p) + d for p in pos for d in (-1, 0, 1) if 0 <= p + d <= n)})
    for s in edges:
        for e in edges:
            if e < s:
                continue
            out = np.zeros(e - s, DT[width])
            wrote = decodeloop.scatter(out, starts, low, vals, s, e)
            keep = (pos >= s) & (pos < e)
            want = np.zeros(e - s, DT[width])
            want[pos[keep] - s] = vals[keep]
            assert wrote == int(keep.sum()) and np.array_equal(out, want), (s, e)
