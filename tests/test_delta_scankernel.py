"""The sender's compiled compare loop (client/delta/scankernel.py), both of its steps
(vector compress, and scalar), against a plain numpy reference, bit for bit: every width,
ragged sizes, runs that start anywhere in a 65536-element block and cross blocks, arrays
at any element offset, the stop past the limit, and no write past the room it was
given. Also the BLOCK16 form's bookkeeping (`scan.Changes`) and its encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightwire.client.delta import codec, scan, scankernel
from weightwire.client.delta.codec import BLOCK, Kind

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 0xA5


def _steps() -> list[str]:
    if not scankernel.compiled():
        return []
    return ["vector", "scalar"] if scankernel.simd_available() else ["scalar"]


pytestmark = pytest.mark.skipif(not scankernel.compiled(), reason="numba is not installed")


def _pair(n: int, width: int, density: float, seed: int, shift: int = 0):  # type: ignore[no-untyped-def]
    """new and old element arrays of n elements at element offset `shift` of their buffers
    (so not aligned to 64 or 8 bytes), `density` of them differing in some byte."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[width]
    raw = rng.integers(0, 256, (n + shift) * width, dtype=np.uint8)
    old = raw.view(dt)[shift:]
    new = old.copy()
    hit = rng.random(n) < density
    flips = rng.integers(1, 256, (int(hit.sum()), width), dtype=np.uint8)
    new.view(np.uint8).reshape(n, width)[hit] ^= flips
    return new, old


def _reference(new: np.ndarray, old: np.ndarray, pos0: int, blocks: int):  # type: ignore[no-untyped-def]
    hit = np.flatnonzero(new != old)
    pos = hit + pos0
    counts = np.bincount(pos >> 16, minlength=blocks).astype(np.uint32)
    return (pos & 0xFFFF).astype(np.uint16), new[hit], counts


def _run(step: str, new, old, pos0: int, limit: int, k0: int = 0):  # type: ignore[no-untyped-def]
    """The kernel into output arrays of exactly the room it asks for, with guards after."""
    n = new.size
    room = min(limit, k0 + n) + scankernel.SPARE
    blocks = max(1, -(-(pos0 + n) // BLOCK))
    low = np.full(room + 16, GUARD, np.uint16)
    val = np.full(room + 16, GUARD, new.dtype)
    counts = np.zeros(blocks + 1, np.uint32)  # one more: must stay 0
    k, done = scankernel.run(
        new, old, low[:room], val[:room], counts[:blocks], k0, limit, pos0, step == "vector"
    )
    assert (low[room:] == GUARD).all() and (val[room:] == GUARD).all(), "wrote past its room"
    assert counts[blocks] == 0
    return k, done, low, val, counts[:blocks]


@pytest.mark.parametrize("step", _steps())
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("n", "pos0", "density"),
    [
        (0, 0, 0.5),
        (1, 0, 1.0),
        (1, BLOCK - 1, 1.0),
        (31, 7, 0.5),
        (33, BLOCK - 17, 1.0),  # a vector's worth that crosses a block: cut there
        (64, 0, 0.0),
        (65, 3, 1.0),
        (1000, BLOCK - 500, 0.3),
        (5000, 12345, 0.042),
        (3 * BLOCK + 77, BLOCK - 3, 0.042),  # several blocks, ragged at both ends
        (2 * BLOCK, 0, 1.0),
        (BLOCK + 1, 5 * BLOCK, 0.001),
    ],
)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_run_matches_numpy(
    step: str, width: int, n: int, pos0: int, density: float, shift: int
) -> None:
    new, old = _pair(n, width, density, seed=n + pos0 + width, shift=shift)
    want_low, want_val, want_counts = _reference(new, old, pos0, max(1, -(-(pos0 + n) // BLOCK)))
    k, done, low, val, counts = _run(step, new, old, pos0, limit=n + 3, k0=3)
    assert done == n
    assert k == 3 + want_low.size
    assert np.array_equal(low[3:k], want_low)
    assert val[3:k].tobytes() == want_val.tobytes()
    assert np.array_equal(counts, want_counts)
    assert np.array_equal(old, new)  # the shadow took every new element
    assert (low[:3] == GUARD).all()  # what it held before k0 is left alone


@pytest.mark.parametrize("step", _steps())
@pytest.mark.parametrize("width", [1, 2, 8])
@pytest.mark.parametrize("limit", [0, 1, 40, 1000])
def test_run_stops_past_the_limit(step: str, width: int, limit: int) -> None:
    """It stops after the step that takes k past the limit: what it kept is the first
    changes, exactly; the shadow moved on over what it did and not further."""
    n, pos0 = 3 * BLOCK + 5, BLOCK - 1000
    new, old = _pair(n, width, 0.05, seed=limit + width, shift=1)
    pristine = old.copy()
    want_low, want_val, _ = _reference(new, old, pos0, 5)
    k, done, low, val, counts = _run(step, new, old, pos0, limit)
    assert limit < k <= limit + scankernel.SPARE
    assert 0 < done < n
    assert np.array_equal(low[:k], want_low[:k])
    assert val[:k].tobytes() == want_val[:k].tobytes()
    assert int(counts.sum()) == k
    assert np.array_equal(old[:done], new[:done])
    assert np.array_equal(old[done:], pristine[done:])
    # exactly at the limit it still completes
    new2, old2 = _pair(4096, width, 0.05, seed=9, shift=0)
    exact = int(np.count_nonzero(new2 != old2))
    k2, done2, *_ = _run(step, new2, old2, 0, exact)
    assert (k2, done2) == (exact, 4096)


def test_run_checks_its_bounds() -> None:
    a = np.zeros(100, np.uint16)
    low, val = np.zeros(200, np.uint16), np.zeros(200, np.uint16)
    with pytest.raises(ValueError, match="blocks"):
        scankernel.run(a, a.copy(), low, val, np.zeros(1, np.uint32), 0, 100, BLOCK - 50)
    with pytest.raises(ValueError, match="room"):
        scankernel.run(a, a.copy(), low[:100], val, np.zeros(1, np.uint32), 0, 100, 0)
    with pytest.raises(ValueError, match="dtype"):
        scankernel.run(a, a.view(np.int16).copy(), low, val, np.zeros(1, np.uint32), 0, 100, 0)


def test_changes_append_extend_and_positions() -> None:
    rng = np.random.default_rng(4)
    n = 5 * BLOCK + 11
    pos = np.sort(rng.choice(n, 3000, replace=False)).astype(np.int64)
    vals = rng.integers(0, 1 << 16, pos.size).astype(np.uint16)
    acc = scan.Changes(n, 2, pos.size)
    acc.append(pos[:1000], vals[:1000])
    part = scan.Changes(n, 2, 2000)  # the rest, found from a block-aligned start
    cut = (int(pos[999]) // BLOCK + 1) * BLOCK
    rest = pos[1000:][pos[1000:] >= cut]
    mid = pos[1000 : 1000 + (pos[1000:] < cut).sum()]
    acc.append(mid, vals[1000 : 1000 + mid.size])
    part.append(rest - cut, vals[1000 + mid.size :])
    acc.extend(part, cut)
    assert np.array_equal(acc.positions, pos)
    assert acc.values.tobytes() == vals.tobytes()
    other = scan.Changes(n, 2, 10)  # an unaligned shift goes through the positions
    other.append(np.array([0, 70000], np.int64), np.array([1, 2], np.uint16))
    acc2 = scan.Changes(n, 2, 10)
    acc2.extend(other, 123)
    assert acc2.positions.tolist() == [123, 70123]
    with pytest.raises(ValueError):
        acc2.append(np.array([6 * BLOCK], np.int64), np.array([1], np.uint16))


@pytest.mark.parametrize("kind", [Kind.POS32, Kind.BLOCK16, Kind.BITMAP])
@pytest.mark.parametrize("k", [0, 1, 777, 40_000])
def test_encode_blocks_into_matches_encode_body(kind: Kind, k: int) -> None:
    n = 3 * BLOCK + 5
    rng = np.random.default_rng(k)
    pos = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    ch = scan.Changes(n, 2, k)
    ch.append(pos, rng.integers(0, 1 << 16, k).astype(np.uint16))
    ref = codec.encode_body(torch.from_numpy(pos), torch.from_numpy(ch.values.copy()), n, 2, kind)
    out = np.full(codec.body_size(kind, n, k, 2) + 1, 7, dtype=np.uint8)
    codec.encode_blocks_into(out[1:], ch.counts, ch.low[:k], ch.values, n, kind)  # unaligned
    assert out[0] == 7 and out[1:].tobytes() == ref.numpy().tobytes()


@pytest.mark.parametrize(("first", "then"), [(2, 2), (2, 4), (8, 1)])
def test_changes_reuse_spare_buffers(first: int, then: int) -> None:
    """A payload's changes in the buffers an earlier one used (another width too): the
    same results as in fresh ones; buffers too small are not reused."""
    a = scan.Changes(10_000, first, 10_000)
    a.append(np.arange(0, 20_000, 2, dtype=np.int64)[:5000], np.ones(5000, DTYPES[first]))
    spare = a.buffers()
    new, old = _pair(20_000, then, 0.1, seed=1)
    fresh = scan.Changes(20_000, then, 4_000)
    reused = scan.Changes(20_000, then, 4_000, spare=spare)
    assert np.shares_memory(reused.low, spare.low) and np.shares_memory(reused.val, spare.val)
    for acc in (fresh, reused):
        assert scan.scan(new.view(np.uint8), old.copy().view(np.uint8), acc, 0, None)
    assert np.array_equal(reused.positions, fresh.positions)
    assert reused.values.tobytes() == fresh.values.tobytes()
    big = scan.Changes(1 << 20, then, 1 << 20, spare=spare)  # needs more room than spare has
    assert not np.shares_memory(big.low, spare.low)


@pytest.mark.parametrize("step", _steps())
@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize(
    ("n", "pos0", "density"),
    [(1, 0, 1.0), (77, 2 * 999, 0.5), (5000, BLOCK - 1000, 0.042), (3 * BLOCK + 5, 2, 0.3)],
)
def test_pairs_count_the_elements_changed_in_both_bytes(
    step: str, width: int, n: int, pos0: int, density: float
) -> None:
    """bf16 elements compared as bytes (from an even position) or as elements: the loop
    counts the elements that changed in both bytes, exactly, whichever bytes changed
    (low only, high only, both), across vector, scalar and tail steps and block edges."""
    rng = np.random.default_rng(n)
    old16 = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new16 = old16.copy()
    hit = rng.random(n) < density
    flips = rng.choice(np.array([0x0001, 0x0100, 0x0101, 0x8080], np.uint16), int(hit.sum()))
    new16[hit] ^= flips
    new, old = new16.view(DTYPES[width]), old16.copy().view(DTYPES[width])
    room = 2 * n + scankernel.SPARE
    low, val = np.zeros(room, np.uint16), np.zeros(room, new.dtype)
    counts = np.zeros(max(1, -(-(pos0 + new.size) // BLOCK)), np.uint32)
    pairs = np.zeros(1, np.int64)
    k, done = scankernel.run(new, old, low, val, counts, 0, new.size, pos0, step == "vector", pairs)
    assert done == new.size and np.array_equal(new, old)
    both = int(np.isin(flips, [0x0101, 0x8080]).sum())
    assert int(pairs[0]) == both
    changed_bytes = int(np.count_nonzero(new16.view(np.uint8) != old16.view(np.uint8)))
    assert k == (changed_bytes if width == 1 else int(hit.sum()))


@pytest.mark.parametrize("width", [1, 2])
def test_pairs_of_the_numpy_compare_match_the_kernel(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    """The compare without numba counts the same pairs (scan's numpy path)."""
    new16 = np.arange(40000, dtype=np.uint16)
    old16 = new16.copy()
    old16[::7] ^= 0x0101  # both bytes
    old16[3::7] ^= 0x0001  # the low byte only
    got = []
    for kernel in (scan._kernel, None):
        monkeypatch.setattr(scan, "_kernel", kernel)
        acc = scan.Changes(80000 // width, width, 80000 // width)
        assert scan.scan(new16.view(np.uint8), old16.view(np.uint8).copy(), acc, 0, None)
        got.append((acc.k, int(acc.pairs[0])))
    both, low = len(old16[::7]), len(old16[3::7])
    assert got[0] == got[1] == ((2 * both + low) if width == 1 else both + low, both)
