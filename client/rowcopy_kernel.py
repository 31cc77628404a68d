"""The Triton kernel behind `rowcopy.RowCopies` (imported only when it runs).

One program copies a tile of `BLOCK_R` runs of one job, `BLOCK_C` words at a time. A job
is a row of the int64 table: source address, destination address, run count, run length
and source stride (both in words). The destination is dense: run i lands at i * length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_GRID_Y = 65535


@triton.jit  # type: ignore[misc]
def _copy_runs(table, typed, tiles_y, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # type: ignore[no-untyped-def]
    job = table + tl.program_id(0) * 5
    src = tl.load(job).to(typed.dtype)
    dst = tl.load(job + 1).to(typed.dtype)
    count = tl.load(job + 2)
    length = tl.load(job + 3)
    stride = tl.load(job + 4)
    for tile in range(tl.program_id(1), tl.cdiv(count, BLOCK_R), tiles_y):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        rmask = r < count
        for c0 in range(0, length, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = rmask[:, None] & (c < length)[None, :]
            v = tl.load(src + r[:, None] * stride + c[None, :], mask=mask)
            tl.store(dst + r[:, None] * length + c[None, :], v, mask=mask)


def launch(table: torch.Tensor, typed: torch.Tensor, widest: int, most_runs: int) -> None:
    """All of `table`'s jobs, on the current stream. `widest`: the longest run, in words;
    `most_runs`: the largest run count."""
    block_c = min(triton.next_power_of_2(max(widest, 16)), 512)
    block_r = max(1, 4096 // block_c)
    tiles_y = min(_MAX_GRID_Y, triton.cdiv(most_runs, block_r))
    grid = (table.shape[0], tiles_y)
    _copy_runs[grid](table, typed, tiles_y, BLOCK_R=block_r, BLOCK_C=block_c)
