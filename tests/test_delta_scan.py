"""The sender's host scan: one pass finds exactly the changed elements (the codec's own
compare is the reference), leaves the shadow equal to the new bytes, feeds the range
hash the new bytes, and stops once the changes cannot fit; compiled and numpy paths
alike. Also the exact fit bound and the in-place body encoder."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings

from weightwire.client.delta import codec, scan, scankernel
from weightwire.client.delta.codec import Kind


def _pair(nbytes: int, width: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, nbytes, dtype=np.uint8)
    new = old.copy()
    n = nbytes // width
    hit = rng.random(n) < density
    flips = rng.integers(1, 256, (int(hit.sum()), width), dtype=np.uint8)
    view = new[: n * width].reshape(n, width)
    view[hit] ^= flips  # a nonzero xor in some byte of each chosen element
    return new, old


@pytest.fixture(params=["vector", "scalar", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled loop with its vector step (where the CPU has it), its scalar step
    alone, or numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(scan, "_kernel", None)
    elif not scan.compiled():
        pytest.skip("numba is not installed")
    elif request.param == "vector" and not scankernel.simd_available():
        pytest.skip("no AVX-512 VBMI2 here")
    else:
        monkeypatch.setattr(scankernel, "SIMD", request.param == "vector")
    return str(request.param)


# the `path` fixture holds for every example (it only picks the compiled or numpy loop)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    elements=st.integers(0, 3000),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.3, 1.0]),
    offset=st.integers(0, 3),
    chunk=st.sampled_from([64, 4096, 1 << 20]),
    seed=st.integers(0, 2**16),
    base=st.sampled_from([5, 99, codec.BLOCK - 700, 3 * codec.BLOCK - 1]),
)
def test_scan_finds_every_change_and_moves_the_shadow(
    path: str,
    width: int,
    elements: int,
    density: float,
    offset: int,
    chunk: int,
    seed: int,
    base: int,
) -> None:
    """At element `base` of its payload's stream (some blocks cross one of its 65536-element
    blocks), after 5 changes of other blocks, unaligned to 8 bytes, in chunks of any size."""
    new_buf, old_buf = _pair(elements * width + 8 * width, width, density, seed)
    # blocks start anywhere aligned to the element width, not only to 8 bytes
    lo = offset * width
    new, old = new_buf[lo : lo + elements * width], old_buf[lo : lo + elements * width]
    want = codec.changes(torch.from_numpy(new.copy()), torch.from_numpy(old.copy()), width)
    want_np = want.numpy()
    h = xxhash.xxh3_64()
    pre_old = old_buf.copy()
    mp = pytest.MonkeyPatch()
    mp.setattr(scan, "CHUNK", chunk)
    acc = scan.Changes(base + elements, width, elements + 5)
    acc.append(np.arange(5, dtype=np.int64), np.full(5, 7, scan.NP_INT[width]))
    try:
        assert scan.scan(new, old, acc, base, h)
    finally:
        mp.undo()
    assert acc.k == 5 + want_np.size
    assert np.array_equal(acc.positions[5:], want_np + base)
    assert np.array_equal(acc.positions[:5], np.arange(5))
    assert int(acc.counts.sum()) == acc.k
    el = new.view(scan.NP_INT[width]) if elements else np.zeros(0, scan.NP_INT[width])
    assert acc.values[5 * width :].tobytes() == el[want_np].tobytes()
    assert acc.values[: 5 * width].tobytes() == np.full(5, 7, scan.NP_INT[width]).tobytes()
    assert np.array_equal(old, new)  # the shadow took every new byte
    assert np.array_equal(old_buf[:lo], pre_old[:lo])  # and nothing outside the block
    assert np.array_equal(old_buf[lo + elements * width :], pre_old[lo + elements * width :])
    assert h.intdigest() == xxhash.xxh3_64_intdigest(new.tobytes())


def test_scan_stops_past_the_limit_but_moves_the_shadow_on(path: str) -> None:
    new, old = _pair(1 << 16, 2, 0.2, 1)
    want = int(np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)))
    h = xxhash.xxh3_64()
    assert not scan.scan(new, old, scan.Changes(1 << 15, 2, want - 1), 0, h)
    assert np.array_equal(old, new)
    assert h.intdigest() == xxhash.xxh3_64_intdigest(new.tobytes())
    new2, old2 = _pair(1 << 16, 2, 0.2, 1)
    acc = scan.Changes(1 << 15, 2, want)
    assert scan.scan(new2, old2, acc, 0, None)  # exactly at the limit: still a delta
    assert acc.k == want


def test_scan_stops_early_on_a_block_projected_past_the_limit(path: str) -> None:
    new, old = _pair(16 << 20, 2, 0.2, 3)  # 16 chunks of 1 MiB
    want = int(np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)))
    acc = scan.Changes(8 << 20, 2, want // 2)
    h = xxhash.xxh3_64()
    assert not scan.scan(new, old, acc, 0, h)
    assert acc.k < want // 4  # it gave up after the first eighth or so
    assert np.array_equal(old, new)
    assert h.intdigest() == xxhash.xxh3_64_intdigest(new.tobytes())


def test_copy_and_sample() -> None:
    new, old = _pair(1 << 20, 2, 0.05, 2)
    changed, compared = scan.sample(new, old, 2)
    assert 0 < compared < (1 << 19) and 0.02 < changed / compared < 0.08
    h = xxhash.xxh3_64()
    scan.copy(new, old, h)
    assert np.array_equal(old, new) and h.intdigest() == xxhash.xxh3_64_intdigest(new)
    assert scan.sample(new, old, 2)[0] == 0


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 400_000), width=st.sampled_from([1, 2, 4, 8]), cap=st.integers(0, 1 << 22))
def test_max_changes_is_the_exact_fit(n: int, width: int, cap: int) -> None:
    def fits(k: int) -> bool:
        return (
            min(codec.body_size(kd, n, k, width) for kd in (Kind.POS32, Kind.BLOCK16, Kind.BITMAP))
            <= cap
        )

    m = codec.max_changes(n, width, cap)
    assert m == -1 or fits(m)
    assert m == n or not fits(m + 1)


@pytest.mark.parametrize("kind", [Kind.POS32, Kind.BLOCK16, Kind.BITMAP])
@pytest.mark.parametrize("k", [0, 1, 777, 40_000])
def test_encode_body_into_matches_encode_body(kind: Kind, k: int) -> None:
    n = 3 * codec.BLOCK + 5
    rng = np.random.default_rng(k)
    pos = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    values = rng.integers(0, 256, 2 * k, dtype=np.uint8)
    ref = codec.encode_body(torch.from_numpy(pos), torch.from_numpy(values), n, 2, kind)
    out = np.full(codec.body_size(kind, n, k, 2) + 1, 7, dtype=np.uint8)
    codec.encode_body_into(out[1:], pos, values, n, kind)  # unaligned on purpose
    assert out[0] == 7 and out[1:].tobytes() == ref.numpy().tobytes()
