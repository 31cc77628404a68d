"""Lossless sparse deltas of one byte stream against the bytes last sent (no I/O).

A stream is `n` elements of `width` bytes (1, 2, 4 or 8), compared as integers of that
width: bitwise, never as floats, so NaNs, signed zeros and FP8 codes are all just bits.
The changed elements are found by position and encoded one of the ways
`weightwire.protocol.delta` lays out (POS32, BLOCK16, BITMAP), whichever is smallest
(`auto`), dense when no delta is smaller.

Positions always come out sorted. Works on CPU and CUDA tensors alike (torch ops only;
numpy on the CPU where it is much faster at finding changes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weightwire.protocol.delta import (
    BLOCK,
    SPARSE,
    Kind,
    best_kind,
    body_size,
    elements,
    max_changes,
)

from . import apply_kernel, decodeloop

__all__ = ["BLOCK", "SPARSE", "Kind", "best_kind", "body_size", "elements", "max_changes"]
_CHUNK = 1 << 18  # elements compared at a time on the CPU


INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class Encoded:
    kind: Kind
    count: int  # changed elements (n for DENSE)
    body: torch.Tensor  # uint8, on the stream's device


def changes(new: torch.Tensor, old: torch.Tensor, width: int) -> torch.Tensor:
    """Sorted int64 positions of the elements whose bytes differ (flat uint8 inputs)."""
    if new.dtype != torch.uint8 or old.dtype != torch.uint8:
        raise TypeError("changes() compares flat uint8 tensors")
    if new.shape != old.shape or new.device != old.device:
        raise ValueError(f"streams differ: {tuple(new.shape)} vs {tuple(old.shape)}")
    n = elements(new.numel(), width)
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=new.device)
    if new.device.type == "cpu":
        return torch.from_numpy(_changes_np(new.numpy(), old.numpy(), width))
    return (new.view(INT[width]) != old.view(INT[width])).nonzero().squeeze(1)


def _changes_np(new: np.ndarray, old: np.ndarray, width: int) -> np.ndarray:
    """Compare in chunks that keep the mask in cache (several times faster than one pass
    over a large stream, whatever the density)."""
    a, b = _np_view(new, width), _np_view(old, width)
    out = []
    for start in range(0, a.size, _CHUNK):
        hit = np.flatnonzero(a[start : start + _CHUNK] != b[start : start + _CHUNK])
        if hit.size:
            out.append(hit + start)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _np_view(raw: np.ndarray, width: int) -> np.ndarray:
    if raw.ctypes.data % width:
        raw = raw.copy()
    return raw.view(NP_INT[width])


def values_at(stream: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The bytes of the elements at `positions`, as flat uint8."""
    if stream.device.type == "cpu":  # numpy's gather is several times faster on the CPU
        got = np.ascontiguousarray(_np_int(stream, width)[positions.numpy()])
        return torch.from_numpy(got.view(np.uint8))
    return stream.view(INT[width])[positions].view(torch.uint8)


def _np_int(t: torch.Tensor, width: int) -> np.ndarray:
    """A CPU uint8 tensor's bytes as integers of `width` (aligned or not)."""
    raw = t.numpy()
    if raw.ctypes.data % width:
        raw = raw.copy()
    return raw.view(NP_INT[width])


def encode(
    new: torch.Tensor,
    old: torch.Tensor,
    width: int,
    *,
    mode: str = "auto",
    positions: torch.Tensor | None = None,
) -> Encoded:
    """`new` against `old` (flat uint8, same size). mode "auto": the smallest encoding, DENSE
    when no delta is smaller; "on": the smallest delta encoding, however large."""
    n = elements(new.numel(), width)
    pos = changes(new, old, width) if positions is None else positions
    k = int(pos.numel())
    kind = best_kind(n, k, width, allow_dense=mode != "on")
    return Encoded(kind, n if kind is Kind.DENSE else k, encode_positions(new, pos, width, kind))


def encode_positions(new: torch.Tensor, pos: torch.Tensor, width: int, kind: Kind) -> torch.Tensor:
    """The body of `kind` for the changes at sorted `pos` of stream `new`."""
    n = elements(new.numel(), width)
    if kind is Kind.DENSE:
        return new.clone()
    return encode_body(pos, values_at(new, pos, width), n, width, kind)


def encode_body(
    pos: torch.Tensor, values: torch.Tensor, n: int, width: int, kind: Kind
) -> torch.Tensor:
    """The body of `kind` (not DENSE) for changes at sorted `pos` of an n-element stream,
    whose new bytes are `values` (k * width, uint8)."""
    dev = values.device
    pos = pos.to(dev)
    if dev.type == "cpu":
        return torch.from_numpy(_encode_body_np(pos.numpy(), values.numpy(), n, kind))
    match kind:
        case Kind.POS32:
            head = _signed(pos, 32).to(torch.int32).view(torch.uint8)
        case Kind.BLOCK16:
            counts = torch.bincount(pos >> 16, minlength=-(-n // BLOCK)).to(torch.int32)
            low = _signed(pos & 0xFFFF, 16).to(torch.int16)
            head = torch.cat([counts.view(torch.uint8), low.view(torch.uint8)])
        case Kind.BITMAP:
            bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=dev)
            bits[pos] = 1
            shifts = torch.arange(8, dtype=torch.uint8, device=dev)
            head = (bits.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)
        case _:
            raise ValueError(f"unknown delta encoding {kind}")
    return torch.cat([head.reshape(-1), values.reshape(-1)])


def _encode_body_np(pos: np.ndarray, values: np.ndarray, n: int, kind: Kind) -> np.ndarray:
    match kind:
        case Kind.POS32:
            head = pos.astype(np.uint32).view(np.uint8)
        case Kind.BLOCK16:
            counts = np.bincount(pos >> 16, minlength=-(-n // BLOCK)).astype(np.uint32)
            low = (pos & 0xFFFF).astype(np.uint16)
            head = np.concatenate([counts.view(np.uint8), low.view(np.uint8)])
        case Kind.BITMAP:
            bits = np.zeros(-(-n // 8) * 8, dtype=bool)
            bits[pos] = True
            head = np.packbits(bits, bitorder="little")
        case _:
            raise ValueError(f"unknown delta encoding {kind}")
    return np.concatenate([head.reshape(-1), values.reshape(-1)])


def encode_body_into(
    dst: np.ndarray, pos: np.ndarray, values: np.ndarray, n: int, kind: Kind
) -> None:
    """`encode_body` on the CPU, written straight into `dst` (uint8, exactly the body's
    size): no body-sized temporary. `values` are the changed elements' bytes (uint8)."""
    k = pos.size
    match kind:
        case Kind.POS32:
            head = 4 * k
            np.copyto(dst[:head].view(np.uint32), pos, casting="unsafe")  # < 2**32: n is
        case Kind.BLOCK16:
            nblocks = -(-n // BLOCK)
            # sorted positions: each block's count from two binary searches, not a pass
            edges = np.searchsorted(pos, np.arange(nblocks + 1, dtype=np.int64) << 16)
            np.copyto(dst[: 4 * nblocks].view(np.uint32), np.diff(edges), casting="unsafe")
            # the cast keeps each position's low 16 bits (modular, like `& 0xFFFF`)
            low = dst[4 * nblocks : 4 * nblocks + 2 * k].view(np.uint16)
            np.copyto(low, pos, casting="unsafe")
            head = 4 * nblocks + 2 * k
        case Kind.BITMAP:
            head = -(-n // 8)
            bits = np.zeros(head * 8, dtype=bool)
            bits[pos] = True
            dst[:head] = np.packbits(bits, bitorder="little")
        case _:
            raise ValueError(f"unknown delta encoding {kind}")
    if dst.size != head + values.size:
        raise ValueError(f"a body of {dst.size} bytes for {head + values.size}")
    dst[head:] = values


def block_positions(counts: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Sorted int64 positions from BLOCK16's per-block counts and low 16 bits (trusted:
    `decode` checks what it receives)."""
    blocks = np.repeat(np.arange(counts.size, dtype=np.int64) << 16, counts.astype(np.int64))
    if blocks.size != low.size:
        raise ValueError(f"BLOCK16 counts add up to {blocks.size}, not {low.size}")
    pos: np.ndarray = blocks | low
    return pos


def block16_parts(
    body: np.ndarray, n: int, k: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A BLOCK16 body (uint8) of k changes of n elements as its three parts: counts
    (uint32), low 16 position bits (uint16), values (unsigned, of the width; a view that
    may be unaligned). Its size is checked, as `decode` does; its contents are not."""
    want = body_size(Kind.BLOCK16, n, k, width)
    if body.size != want:
        raise ValueError(f"BLOCK16 body of {body.size} bytes, expected {want}")
    if not 0 <= k <= n:
        raise ValueError(f"{k} changes of {n} elements")
    if body.ctypes.data % 4:
        body = body.copy()
    nblocks = -(-n // BLOCK)
    head = 4 * nblocks + 2 * k
    counts = body[: 4 * nblocks].view(np.uint32)
    low = body[4 * nblocks : head].view(np.uint16)
    return counts, low, body[head:].view(NP_UINT[width])


def encode_blocks_into(
    dst: np.ndarray, counts: np.ndarray, low: np.ndarray, values: np.ndarray, n: int, kind: Kind
) -> None:
    """`encode_body_into` for changes held in BLOCK16 form (per-block `counts`, at least
    the stream's blocks, the rest zero; `low`: each change's low 16 position bits):
    a BLOCK16 body is three copies; the others are built from the positions."""
    if kind is not Kind.BLOCK16:
        encode_body_into(dst, block_positions(counts, low), values, n, kind)
        return
    nblocks, k = -(-n // BLOCK), low.size
    head = 4 * nblocks + 2 * k
    if dst.size != head + values.size:
        raise ValueError(f"a body of {dst.size} bytes for {head + values.size}")
    if counts[nblocks:].any():
        raise ValueError("BLOCK16 changes past the stream's end")
    np.copyto(dst[: 4 * nblocks].view(np.uint32), counts[:nblocks])
    np.copyto(dst[4 * nblocks : head].view(np.uint16), low)
    dst[head:] = values


def _decode_head_np(kind: Kind, body: np.ndarray, n: int, k: int) -> tuple[np.ndarray, int]:
    match kind:
        case Kind.POS32:
            head = 4 * k
            pos = body[:head].view(np.uint32).astype(np.int64)
        case Kind.BLOCK16:
            nblocks = -(-n // BLOCK)
            fast = decodeloop.block16_positions(
                body[: 4 * nblocks].view(np.uint32),
                body[4 * nblocks : 4 * nblocks + 2 * k].view(np.uint16),
                n,
            )
            if fast is not None:  # checked in the loop
                return fast, 4 * nblocks + 2 * k
            counts = body[: 4 * nblocks].view(np.uint32).astype(np.int64)
            if int(counts.sum()) != k:
                raise ValueError("BLOCK16 counts do not add up to the changes")
            low = body[4 * nblocks : 4 * nblocks + 2 * k].view(np.uint16).astype(np.int64)
            pos = (np.repeat(np.arange(nblocks, dtype=np.int64), counts) << 16) | low
            head = 4 * nblocks + 2 * k
        case Kind.BITMAP:
            head = -(-n // 8)
            pos = np.flatnonzero(np.unpackbits(body[:head], bitorder="little")).astype(np.int64)
            if pos.size != k:
                raise ValueError(f"BITMAP has {pos.size} bits set, the header says {k}")
        case _:
            raise ValueError(f"unknown delta encoding {kind}")
    if pos.size and (int(pos[-1]) >= n or bool((pos[1:] <= pos[:-1]).any())):
        raise ValueError("delta positions are out of range or not increasing")
    return pos, head


def _signed(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative int64 values below 2**bits as the signed values with the same low bits
    (so that a narrowing cast keeps the bits, without relying on overflow)."""
    return x - ((x & (1 << (bits - 1))) << 1)


def _checked(kind: Kind, body: torch.Tensor, n: int, k: int, width: int) -> Kind:
    """`kind` as a Kind, once the body's size and the count of changes are right for it."""
    kind = Kind(kind)
    want = body_size(kind, n, k, width)
    if body.numel() != want:
        raise ValueError(f"{kind.name} body of {body.numel()} bytes, expected {want}")
    if kind is not Kind.DENSE and not 0 <= k <= n:
        raise ValueError(f"{k} changes of {n} elements")
    return kind


def decode(
    kind: Kind, body: torch.Tensor, n: int, k: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted int64 positions, uint8 values) of a body; checks its size. DENSE gives
    every position (use `apply`, which copies it whole)."""
    kind = _checked(kind, body, n, k, width)
    dev = body.device
    if kind is Kind.DENSE:
        return torch.arange(n, device=dev), body
    if dev.type == "cpu":
        raw = body.numpy()
        if raw.ctypes.data % 4:
            raw = raw.copy()
        npos, head = _decode_head_np(kind, raw, n, k)
        return torch.from_numpy(npos), body[head:]
    match kind:
        case Kind.POS32:
            head = 4 * k
            pos = body[:head].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        case Kind.BLOCK16:
            nblocks = -(-n // BLOCK)
            counts = body[: 4 * nblocks].view(torch.int32).to(torch.int64)
            if int(counts.sum()) != k or bool((counts < 0).any()):
                raise ValueError("BLOCK16 counts do not add up to the changes")
            low = body[4 * nblocks : 4 * nblocks + 2 * k].view(torch.int16).to(torch.int64)
            blocks = torch.repeat_interleave(torch.arange(nblocks, device=dev), counts)
            pos = (blocks << 16) | (low & 0xFFFF)
            head = 4 * nblocks + 2 * k
        case Kind.BITMAP:
            head = -(-n // 8)
            shifts = torch.arange(8, dtype=torch.uint8, device=dev)
            bits = (body[:head].unsqueeze(1) >> shifts) & 1
            pos = bits.reshape(-1).nonzero().squeeze(1)
            if pos.numel() != k:
                raise ValueError(f"BITMAP has {pos.numel()} bits set, the header says {k}")
        case _:
            raise ValueError(f"unknown delta encoding {kind}")
    if pos.numel() and (int(pos[-1]) >= n or bool((pos[1:] <= pos[:-1]).any())):
        raise ValueError("delta positions are out of range or not increasing")
    return pos, body[head:]


def apply(out: torch.Tensor, kind: Kind, body: torch.Tensor, k: int, width: int) -> None:
    """Write a decoded body into the flat uint8 stream `out` (same device)."""
    n = elements(out.numel(), width)
    if Kind(kind) is Kind.BLOCK16 and apply_kernel.available(out, body, width):
        _checked(kind, body, n, k, width)
        apply_kernel.block16(out, body, n, k, width)  # decode and scatter in one launch
        return
    pos, values = decode(kind, body, n, k, width)
    if kind == Kind.DENSE:
        out.copy_(values)
        return
    scatter(out, pos, values, width)


def scatter(out: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, width: int) -> None:
    """out's elements at `pos` (element index) := values (k * width bytes)."""
    if pos.numel() == 0:
        return
    if out.device.type == "cpu" and out.data_ptr() % width == 0:
        _np_int(out, width)[pos.numpy()] = _np_int(values, width)
        return
    if out.data_ptr() % width == 0 and out.numel() % width == 0:
        if values.data_ptr() % width:
            values = values.clone()  # a body packs values right after its positions
        out.view(INT[width]).index_copy_(0, pos, values.view(INT[width]))
        return
    byte_pos = (pos * width).unsqueeze(1) + torch.arange(width, device=pos.device)
    out.index_copy_(0, byte_pos.reshape(-1), values)
