"""`tdigest`'s weighted chunk sums on a GPU in one pass (Triton).

`digest.tdigest` hashes a GPU range as Σ_c w_c · Σ_j x_(c·T+j) · t_j (mod 2**64) over its
8-byte words x, a table t of T odd multipliers and per-chunk odd weights w_c. torch does
it as a product tensor and a sum per chunk: the words are read, a product as large is
written and read again (about 570 GB/s of input on an H100). This kernel reads each word
once and keeps the products in registers: one program per chunk of T words, its weighted
sum stored, and torch adds the chunks' values. Integer arithmetic that wraps, so the
order of the additions cannot change a bit of the result: the same value as torch's,
and as numpy's on the CPU (`test_delta_gpu` checks all three).

Where it runs: CUDA tensors with Triton installed (`available`);
`WEIGHTWIRE_DIGEST_TRITON=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from weightwire.client import fp8_kernel
from weightwire.client.lazyjit import LazyKernel

try:
    import triton
except ImportError:  # no Triton: torch's product and sum
    triton = None

ENABLED = os.environ.get("WEIGHTWIRE_DIGEST_TRITON", "1") != "0"
BLOCK = 2048  # words a program reads at a time
_NUM_WARPS = 8


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can sum these words (int64, contiguous, on a GPU)."""
    return (
        triton is not None
        and ENABLED
        and not fp8_kernel.INTERPRETED
        and x.is_cuda
        and x.dtype == torch.int64
        and x.is_contiguous()
    )


def weighted_sums(
    words: torch.Tensor, table: torch.Tensor, first_chunk: int, mul: int, mix: int
) -> torch.Tensor:
    """Per chunk c of `table.numel()` words of `words` (the last one short): w_c times
    Σ_j words[c·T+j] · table[j], wrapping int64, where chunk c is chunk `first_chunk + c`
    of the block (w of chunk k: ((k+1)·mul ^ ((k+1) >> 29)·mix) | 1)."""
    n = words.numel()
    span = table.numel()
    chunks = -(-n // span)
    out = torch.empty(chunks, dtype=torch.int64, device=words.device)
    if chunks:
        _kernel()[(chunks,)](
            words, table, out, n, first_chunk, mul, mix,
            SPAN=span, BLOCK=min(BLOCK, span), num_warps=_NUM_WARPS,
        )  # fmt: skip
    return out


_kernel = LazyKernel(lambda: _sums)


if triton is not None:
    import triton.language as tl

    def _sums(x, t, out, n, first, mul, mix, SPAN: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """One program per chunk of SPAN words: its table-weighted sum times its weight."""
        c = tl.program_id(0).to(tl.int64)
        base = c * SPAN
        acc = tl.zeros((BLOCK,), dtype=tl.int64)
        for j in range(0, SPAN, BLOCK):
            k = j + tl.arange(0, BLOCK)
            i = base + k
            words = tl.load(x + i, mask=i < n, other=0)
            acc += words * tl.load(t + k)
        s = tl.sum(acc, axis=0)
        k1 = first + c + 1
        w = ((k1 * mul) ^ ((k1 >> 29) * mix)) | 1
        tl.store(out + c, s * w)
