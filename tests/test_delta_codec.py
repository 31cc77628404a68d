"""The delta codec: encode -> apply reproduces the new bytes bitwise, whatever the dtype,
density and encoding; sizes meet the issue's bound."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from weightwire.client.delta import codec
from weightwire.client.delta.codec import Kind

DTYPES = {
    "bf16": (torch.bfloat16, 2),
    "fp16": (torch.float16, 2),
    "fp32": (torch.float32, 4),
    "fp8": (torch.float8_e4m3fn, 1),
    "u8": (torch.uint8, 1),
    "i64": (torch.int64, 8),
}


def _pair(
    n: int, dtype: torch.dtype, density: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    old = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    new = old.clone()
    mask = torch.rand(n, generator=g) < density
    if mask.any():
        # flip random bits of the chosen elements (NaN patterns, -0.0 and all)
        flips = torch.randint(1, 256, (int(mask.sum()), size), dtype=torch.uint8, generator=g)
        new.view(-1, size)[mask] ^= flips
    return new, old


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(0, 5000),
    dtype=st.sampled_from(sorted(DTYPES)),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.1, 0.5, 1.0]),
    mode=st.sampled_from(["auto", "on"]),
    seed=st.integers(0, 2**31),
)
def test_encode_apply_roundtrip(n: int, dtype: str, density: float, mode: str, seed: int) -> None:
    dt, width = DTYPES[dtype]
    new, old = _pair(n, dt, density, seed)
    enc = codec.encode(new, old, width, mode=mode)
    assert enc.body.numel() == codec.body_size(enc.kind, n, enc.count, width)
    out = old.clone()
    codec.apply(out, enc.kind, enc.body, enc.count, width)
    assert torch.equal(out, new)
    if mode == "auto":
        assert enc.body.numel() <= n * width
    else:
        assert enc.kind is not Kind.DENSE


@pytest.mark.parametrize("kind", [Kind.POS32, Kind.BLOCK16, Kind.BITMAP, Kind.DENSE])
@pytest.mark.parametrize("density", [0.0, 0.02, 1.0])
def test_every_encoding_roundtrips(kind: Kind, density: float) -> None:
    """Each encoding on its own, across several 65536-element blocks (BLOCK16's high parts)."""
    new, old = _pair(200_003, torch.bfloat16, density, 7)
    pos = codec.changes(new, old, 2)
    body = codec.encode_positions(new, pos, 2, kind)
    out = old.clone()
    codec.apply(out, kind, body, 200_003 if kind is Kind.DENSE else pos.numel(), 2)
    assert torch.equal(out, new)


def test_fp8_codes_and_scales() -> None:
    """An FP8 destination: 1-byte codes and fp32 scales, each compared bitwise."""
    codes_new, codes_old = _pair(4096, torch.float8_e4m3fn, 0.02, 1)
    scales_new, scales_old = _pair(32, torch.float32, 0.1, 2)
    for new, old, width in ((codes_new, codes_old, 1), (scales_new, scales_old, 4)):
        enc = codec.encode(new, old, width)
        out = old.clone()
        codec.apply(out, enc.kind, enc.body, enc.count, width)
        assert torch.equal(out, new)


def test_nan_and_signed_zero_are_bits() -> None:
    """A float compare would call NaN != NaN changed and -0.0 == 0.0 unchanged: bits decide."""
    # bf16 bits: NaN, +0.0, 1.0, NaN  ->  the same NaN, -0.0, 1.0, a NaN with another payload
    old = torch.tensor([0x7FC0, 0x0000, 0x3F80, 0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    new = torch.tensor([0x7FC0, -0x8000, 0x3F80, 0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    assert bool(torch.isnan(old[0])) and bool(new[1] == old[1])
    pos = codec.changes(new.view(torch.uint8), old.view(torch.uint8), 2)
    assert pos.tolist() == [1, 3]


@pytest.mark.parametrize("density", [0.01, 0.02, 0.03])
def test_wire_bound_bf16(density: float) -> None:
    """Issue 17: <= 3 x density x dense bytes at 1-3 % density for bf16."""
    n = 1 << 20
    new, old = _pair(n, torch.bfloat16, density, 3)
    enc = codec.encode(new, old, 2)
    actual = enc.count / n
    assert enc.kind is Kind.BLOCK16
    assert enc.body.numel() <= 3 * actual * 2 * n


def test_auto_goes_dense_when_delta_is_not_smaller() -> None:
    new, old = _pair(10_000, torch.bfloat16, 1.0, 4)
    assert codec.encode(new, old, 2).kind is Kind.DENSE


def test_bad_bodies_are_refused() -> None:
    new, old = _pair(1000, torch.bfloat16, 0.05, 5)
    enc = codec.encode(new, old, 2, mode="on")
    with pytest.raises(ValueError):
        codec.decode(enc.kind, enc.body[:-1], 1000, enc.count, 2)
    with pytest.raises(ValueError):
        codec.elements(3, 2)


def test_tdigest_is_one_function_on_every_path() -> None:
    """The GPU checksum: numpy's CPU path and torch's (the CUDA one) agree bit for bit, and
    one flipped bit anywhere, a shift or a truncation changes it."""
    from weightwire.client.delta import digest

    x = torch.randint(0, 256, (3 * digest.TABLE * 8 + 13,), dtype=torch.uint8)
    words, table = digest._words(x), digest._table(x.device)
    full = words.numel() // digest.TABLE
    by_torch = (words[: full * digest.TABLE].view(full, digest.TABLE) * table).sum(1)
    assert torch.equal(by_torch, digest._chunk_sums(words, table)[:full])
    base = digest.tdigest([x])
    for at in (0, 7, 8 * digest.TABLE + 3, x.numel() - 1):
        y = x.clone()
        y[at] ^= 0x10
        assert digest.tdigest([y]) != base
    assert digest.tdigest([x[1:]]) == digest.tdigest([x[1:].clone()])  # unaligned views
    assert digest.tdigest([x[:-1]]) != base
    assert digest.tdigest([x[:100], x[100:]]) != base  # blocks are part of what is hashed


def test_block16_compiled_decode_equals_numpy_and_refuses_the_same() -> None:
    """The engine's compiled BLOCK16 decode (numba) gives numpy's positions, and refuses
    bodies whose counts do not add up or whose positions go backwards or out of range."""
    import numpy as np

    from weightwire.client.delta import codec, decodeloop

    if decodeloop._block16 is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    n = 5 * codec.BLOCK + 123
    pos = np.sort(rng.choice(n, 4000, replace=False)).astype(np.int64)
    nb = -(-n // codec.BLOCK)
    counts = np.bincount(pos >> 16, minlength=nb).astype(np.uint32)
    low = (pos & 0xFFFF).astype(np.uint16)
    assert np.array_equal(decodeloop.block16_positions(counts, low, n), pos)
    bad = counts.copy()
    bad[-1] += 1  # one count too many
    with pytest.raises(ValueError, match="add up"):
        decodeloop.block16_positions(bad, low, n)
    swapped = low.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # not increasing
    with pytest.raises(ValueError, match="not increasing"):
        decodeloop.block16_positions(counts, swapped, n)
    with pytest.raises(ValueError, match="out of range"):
        decodeloop.block16_positions(counts, low, int(pos[-1]))
