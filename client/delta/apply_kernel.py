"""A BLOCK16 delta applied on a GPU in one launch (Triton): decode and scatter together.

torch's path (`codec.decode`, then `codec.scatter`) expands each change's position to an
int64 (a `repeat_interleave` of the block numbers, a shift, an or), checks the positions
with two reductions and a host sync each, then `index_copy_`s the values: about 770 GB/s
of dense bytes for FP8 codes at 1 % on an H100, where the engine's work bounds a delta
version. Here one program per block of 65536 elements reads that block's count, its
positions' low 16 bits and its values, and stores each value where it goes; the same
program checks that the block's positions increase and stay inside the stream, and
counts any that do not on the device. Two host syncs per body: the counts' sum (before
anything is written) and the count of bad positions (after: a body whose positions are
wrong within a block has then written some of its values, inside the stream only; the
caller fails the version, as for a body that fails its checksum).

Where it runs: CUDA tensors with Triton installed; `WEIGHTWIRE_APPLY_TRITON=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from weightwire.client import fp8_kernel
from weightwire.client.lazyjit import LazyKernel

try:
    import triton
except ImportError:  # no Triton: torch's decode and index_copy_
    triton = None

ENABLED = os.environ.get("WEIGHTWIRE_APPLY_TRITON", "1") != "0"
BLOCK = 1 << 16  # elements per BLOCK16 block
VEC = 1024  # changes a program handles at a time
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available(out: torch.Tensor, body: torch.Tensor, width: int) -> bool:
    """Whether `block16` can apply a body of `body` into `out` (flat uint8 tensors)."""
    return (
        triton is not None
        and ENABLED
        and not fp8_kernel.INTERPRETED
        and out.is_cuda
        and body.device == out.device
        and width in _INT
        and out.data_ptr() % width == 0
        and out.numel() % width == 0
    )


def block16(out: torch.Tensor, body: torch.Tensor, n: int, k: int, width: int) -> None:
    """Write a BLOCK16 body of `k` changes into `out` (`n` elements of `width` bytes), its
    size already checked (`codec.apply`). Raises ValueError for counts that do not add up
    to `k` (nothing written) and for positions that do not increase within a block or
    fall outside the stream."""
    nblocks = -(-n // BLOCK)
    head = 4 * nblocks + 2 * k
    counts = body[: 4 * nblocks]
    if counts.data_ptr() % 4:
        counts = counts.clone()
    counts = counts.view(torch.int32)
    lows = body[4 * nblocks : head]
    if lows.data_ptr() % 2:
        lows = lows.clone()
    lows = lows.view(torch.int16)
    values = body[head:]
    if values.data_ptr() % width:
        values = values.clone()
    values = values.view(_INT[width])
    wide = counts.to(torch.int64)
    total, lowest = torch.stack([wide.sum(), wide.min()]).tolist() if nblocks else (0, 0)
    if total != k or lowest < 0:
        raise ValueError("BLOCK16 counts do not add up to the changes")
    if not k:
        return
    starts = torch.cumsum(wide, 0) - wide
    bad = torch.zeros(1, dtype=torch.int32, device=out.device)
    _kernel()[(nblocks,)](
        out.view(_INT[width]), counts, starts, lows, values, bad, n, BLOCK=BLOCK, VEC=VEC
    )
    if int(bad.item()):
        raise ValueError("delta positions are out of range or not increasing")


_kernel = LazyKernel(lambda: _apply)


if triton is not None:
    import triton.language as tl

    def _apply(out, counts, starts, lows, values, bad, n, BLOCK: tl.constexpr, VEC: tl.constexpr):  # type: ignore[no-untyped-def]
        """One program per block: its changes, VEC at a time."""
        b = tl.program_id(0).to(tl.int64)
        count = tl.load(counts + b).to(tl.int64)
        start = tl.load(starts + b)
        wrong = tl.zeros((VEC,), dtype=tl.int32)
        for s in range(0, count, VEC):
            j = s + tl.arange(0, VEC).to(tl.int64)
            inside = j < count
            i = start + j
            low = tl.load(lows + i, mask=inside, other=0).to(tl.int64) & 0xFFFF
            before = tl.load(lows + i - 1, mask=inside & (j > 0), other=-1).to(tl.int64)
            before = tl.where(j > 0, before & 0xFFFF, -1)
            pos = b * BLOCK + low
            ok = inside & (low > before) & (pos < n)
            wrong += (inside & ~ok).to(tl.int32)
            tl.store(out + pos, tl.load(values + i, mask=ok), mask=ok)
        nbad = tl.sum(wrong, axis=0)
        if nbad > 0:
            tl.atomic_add(bad, nbad)
