"""Checksums of written ranges, the same at both ends of a version.

Per range: xxh3-64 of its bytes where the destination region is host memory (the engine
hashes its own memory in place), or, where it is GPU memory, a position-weighted sum
that torch computes identically on any device (so the engine hashes on its GPU, and a
sender on whatever device its bytes are). A version's checksum for one (sender,
destination) is xxh3-64 of the per-range checksums in trailer order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
import xxhash

from . import digest_kernel
from .frames import Range

MASK = (1 << 64) - 1
TABLE = 1 << 16
_CHUNK_WORDS = 1 << 25  # 256 MiB of words at a time (bounded temporaries)
_tables: dict[torch.device, torch.Tensor] = {}
_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MIX = 0xBF58476D1CE4E5B9 - (1 << 64)

PiecesOf = Callable[[int, int, int], list[torch.Tensor]]
"""pieces_of(region, offset, length) -> flat uint8 tensors that are those bytes, in order."""


def _table(device: torch.device) -> torch.Tensor:
    """TABLE odd 64-bit multipliers (splitmix64 of 1..TABLE), cached per device."""
    t = _tables.get(device)
    if t is None:
        z = np.arange(1, TABLE + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
        t = _tables[device] = torch.from_numpy(z.view(np.int64)).to(device)
    return t


def _words(block: torch.Tensor) -> torch.Tensor:
    """A byte block as little-endian int64 words, the last one zero-padded."""
    n = block.numel()
    whole = n - n % 8
    main = block[:whole]
    if main.data_ptr() % 8:
        main = main.clone()
    words = main.view(torch.int64)
    if whole == n:
        return words
    tail = torch.zeros(8, dtype=torch.uint8, device=block.device)
    tail[: n - whole] = block[whole:]
    return torch.cat([words, tail.view(torch.int64)])


def _chunk_sums(part: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Σ_j x_(c·T+j) · t_j per chunk c of TABLE words (wrapping), numpy on the CPU (torch's
    CPU int64 kernels are ~10x slower there)."""
    full = part.numel() // TABLE
    rest = part.numel() - full * TABLE
    if part.device.type == "cpu":
        x, t = part.numpy().view(np.uint64), table.numpy().view(np.uint64)
        # einsum multiplies and adds in uint64 (wrapping) without a temporary array
        out = np.einsum("ij,j->i", x[: full * TABLE].reshape(full, TABLE), t)
        if rest:
            tail = (x[full * TABLE :] * t[:rest]).sum(dtype=np.uint64)
            out = np.concatenate([out, np.asarray([tail], dtype=np.uint64)])
        return torch.from_numpy(out.view(np.int64))
    sums = (part[: full * TABLE].view(full, TABLE) * table).sum(1)
    if rest:
        sums = torch.cat([sums, (part[full * TABLE :] * table[:rest]).sum().view(1)])
    return sums


def tdigest(blocks: Iterable[torch.Tensor]) -> int:
    """Per block: its 8-byte words x_i, Σ_c w_c · Σ_j x_(c·T+j) · t_j mod 2**64 with odd
    multipliers t_j (a table of T) and w_c (of the chunk index c), plus the length; the
    blocks' values are combined with xxh3. Exact integer math (wrapping int64 sums and
    products), so CPU and CUDA agree bit for bit; one pass over the bytes, the table in
    cache: a change of any one word always changes it."""
    parts = []
    for block in blocks:
        x = _words(block)
        table = _table(block.device)
        total = torch.zeros((), dtype=torch.int64, device=block.device)
        for start in range(0, x.numel(), _CHUNK_WORDS):
            part = x[start : start + _CHUNK_WORDS]
            if digest_kernel.available(part):  # one pass, the products in registers
                weighted = digest_kernel.weighted_sums(part, table, start // TABLE, _MUL, _MIX)
                total = total + weighted.sum()
                continue
            sums = _chunk_sums(part, table)
            c = torch.arange(
                start // TABLE + 1, start // TABLE + 1 + sums.numel(), device=block.device
            )
            w = ((c * _MUL) ^ ((c >> 29) * _MIX)) | 1
            total = total + (sums * w).sum()
        parts.append((int(total.item()) + block.numel() * 0x100000001B3) & MASK)
    return combine(parts)


def xdigest(blocks: Iterable[torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for block in blocks:
        if block.numel():
            h.update(block.contiguous().numpy().data)
    return h.intdigest()


def range_digest(blocks: list[torch.Tensor], gpu: bool) -> int:
    """One range's checksum: `tdigest` for a GPU destination, xxh3-64 for host memory."""
    if gpu:
        return tdigest(blocks)
    return xdigest(b if b.device.type == "cpu" else b.cpu() for b in blocks)


def combine(parts: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(parts, dtype="<u8").tobytes())


def range_blocks(pieces_of: PiecesOf, r: Range) -> list[torch.Tensor]:
    """One tensor per block of the range (a block spanning tensors is copied together:
    `tdigest` hashes blocks, as the sender has them)."""
    region, offset, length, count, stride = r
    out = []
    for i in range(count):
        pieces = pieces_of(region, offset + i * stride, length)
        out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    return out


def digest(ranges: Iterable[Range], pieces_of: PiecesOf, gpu_regions: Callable[[int], bool]) -> int:
    """The checksum of `ranges` read through `pieces_of`; `gpu_regions(region)` says which
    destination regions are GPU memory (hashed with `tdigest`)."""
    return combine([range_digest(range_blocks(pieces_of, r), gpu_regions(r[0])) for r in ranges])
