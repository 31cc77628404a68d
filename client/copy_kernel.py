"""A bucket's plain copies in one launch (Triton), over a descriptor table made once.

`CopyBatch` takes (source, destination) byte ranges: contiguous tensors anywhere on one
GPU (a trainer's parameters) and views of one destination (staging, or an engine's memory
when packing in place). The table holds, per pair, its source and destination offsets
(relative to a 16-byte aligned tensor of each side) and its length; a second table maps
each program to (pair, chunk). Every program copies one `CHUNK`-byte chunk: the grid is
the bucket's bytes over CHUNK, whatever the number of pairs, so a bucket of 75 expert
tensors is one launch that fills the GPU instead of a multi-tensor copy's several
launches of 320 blocks each (0.46 of the same-GPU copy rate measured on an H100 for bf16
packed in place).

Pairs whose offsets and lengths are multiples of 16 bytes (all of them, as the planner
aligns) go to an aligned launch: the table stores them in 16-byte units and the kernel
multiplies back by a constant, so Triton moves 16 bytes per access, as int32 words (one
program per CHUNK bytes); the rest to a byte-by-byte one (BYTE_CHUNK bytes per program).
Captured in the bucket's CUDA graph with its other launches.

Runs where `fp8_kernel` runs (CUDA compiled; CPU tensors under TRITON_INTERPRET=1);
`WEIGHTWIRE_COPY_TRITON=0` turns it off (copies go back to torch's multi-tensor copy).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import fp8_kernel
from .lazyjit import LazyKernel

try:
    import triton
except ImportError:  # no Triton: torch's copies
    triton = None

ENABLED = os.environ.get("WEIGHTWIRE_COPY_TRITON", "1") != "0"
CHUNK = 32768  # bytes per program (aligned launch)
BYTE_CHUNK = 4096  # bytes per program of the byte-by-byte launch
_NUM_WARPS = 8


def available(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel can copy between these tensors."""
    if triton is None or not ENABLED or not tensors:
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    return next(iter(devices)).type == ("cpu" if fp8_kernel.INTERPRETED else "cuda")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (same storage)."""
    return t.reshape(-1).view(torch.uint8)


class CopyBatch:
    """Copies `(src, dst)` pairs (contiguous tensors of equal byte size) by one launch per
    alignment class. The tables are made once, on the destination's device; the tensors'
    memory must stay where it is (held here)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if triton is None:
            raise RuntimeError("Triton is not installed")
        if not pairs:
            raise ValueError("no pairs to copy")
        self.pairs = tuple(pairs)  # held: their storage must outlive the tables
        for src, dst in pairs:
            if not (src.is_contiguous() and dst.is_contiguous()):
                raise ValueError("copy pairs must be contiguous")
            if src.nbytes != dst.nbytes:
                raise ValueError(f"copy pair of {src.nbytes} and {dst.nbytes} bytes")

        # the bases: a tensor of each side at a 16-byte boundary, a multiple of 16 bytes
        # long (its bytes also seen as int32 words: the aligned launch's) where there is one
        def base(ts: list[torch.Tensor]) -> torch.Tensor:
            good = (t for t in ts if t.data_ptr() % 16 == 0 and t.nbytes % 16 == 0 and t.nbytes)
            return _bytes(next(good, ts[0]))

        self.src = base([s for s, _ in pairs])
        self.dst = base([d for _, d in pairs])
        s0, d0 = self.src.data_ptr(), self.dst.data_ptr()
        bases = s0 % 16 == 0 and d0 % 16 == 0 and self.src.nbytes % 16 == self.dst.nbytes % 16 == 0
        parts: dict[bool, tuple[list[int], list[int]]] = {}
        for src, dst in pairs:
            so, do, n = src.data_ptr() - s0, dst.data_ptr() - d0, src.nbytes
            if not n:
                continue
            aligned = bases and so % 16 == 0 and do % 16 == 0 and n % 16 == 0
            desc, tiles = parts.setdefault(aligned, ([], []))
            i = len(desc) // 3
            desc += [so // 16, do // 16, n // 16] if aligned else [so, do, n]
            for k in range(-(-n // (CHUNK if aligned else BYTE_CHUNK))):
                tiles += [i, k]
        device = self.dst.device
        self.launches: list[tuple[bool, torch.Tensor, torch.Tensor, int]] = []
        for aligned, (desc, tiles) in sorted(parts.items()):
            self.launches.append((
                aligned,
                torch.tensor(desc, dtype=torch.int64).to(device),
                torch.tensor(tiles, dtype=torch.int32).to(device),
                len(tiles) // 2,
            ))  # fmt: skip
        self.nbytes = sum(src.nbytes for src, _ in pairs)

    def run(self) -> None:
        for aligned, desc, tiles, n in self.launches:
            if aligned:  # in int32 words: registers hold the data packed
                src, dst, chunk = self.src.view(torch.int32), self.dst.view(torch.int32), CHUNK // 4
            else:
                src, dst, chunk = self.src, self.dst, BYTE_CHUNK
            _kernel()[(n,)](
                src, dst, desc, tiles, CHUNK=chunk, ALIGNED=aligned, num_warps=_NUM_WARPS
            )


_kernel = LazyKernel(lambda: _copy)


if triton is not None:
    import triton.language as tl

    def _copy(src, dst, desc, tiles, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):  # type: ignore[no-untyped-def]
        """One program per chunk (CHUNK elements: int32 words aligned, else bytes)."""
        pid = tl.program_id(0)
        p = tl.load(tiles + pid * 2).to(tl.int64)
        k = tl.load(tiles + pid * 2 + 1).to(tl.int64)
        if ALIGNED:  # stored in 16-byte units, moved in words: Triton sees the alignment
            so = tl.load(desc + p * 3) * 4
            do = tl.load(desc + p * 3 + 1) * 4
            n = tl.load(desc + p * 3 + 2) * 4
        else:
            so = tl.load(desc + p * 3)
            do = tl.load(desc + p * 3 + 1)
            n = tl.load(desc + p * 3 + 2)
        o = k * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
        inside = o < n
        x = tl.load(src + so + o, mask=inside)
        tl.store(dst + do + o, x, mask=inside)
