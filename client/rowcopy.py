"""Many strided copies in one kernel launch: each a source whose elements are runs of
contiguous bytes at a fixed stride (a box of a row-major tensor) into contiguous bytes.

A layer of experts, sharded by rows in the trainer and by columns in the engines, packs as
hundreds of such copies (one per expert and engine; 768-byte runs for Qwen3-30B-A3B's w2).
As separate copy kernels they run at a fraction of the memory's speed even when replayed
from a CUDA graph; here one launch copies all of a bucket's, with the job table (addresses,
run counts, lengths and strides) built once and kept on the device.

The kernel is Triton's (`rowcopy_kernel`). Without Triton, or where it fails to compile,
`RowCopies.build` returns None and the caller copies one pair at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger("weightwire.client.pack")

MIN_RUN_BYTES = 32  # shorter runs copy as fast through torch's own strided copy
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_kernel_failure_logged = False


@dataclass(frozen=True)
class Runs:
    """`count` runs of `length` contiguous elements, the starts `stride` elements apart."""

    count: int
    length: int
    stride: int


def runs_of(t: torch.Tensor) -> Runs | None:
    """`t`'s elements as evenly spaced contiguous runs, or None if they are not (more than
    two strides remain after merging the dimensions that are contiguous with each other)."""
    merged = [(1, 1)]  # (size, stride), outermost first; a unit run to merge into
    for n, s in reversed([d for d in zip(t.shape, t.stride(), strict=True) if d[0] != 1]):
        inner_n, inner_s = merged[0]
        if s == inner_n * inner_s:
            merged[0] = (n * inner_n, inner_s)
        else:
            merged.insert(0, (n, s))
    if len(merged) == 1:
        return Runs(1, merged[0][0], merged[0][0])
    if len(merged) > 2:
        return None
    (count, stride), (length, _) = merged
    return Runs(count, length, stride)


def _word(*values: int) -> int:
    for w in _WORDS:
        if all(v % w == 0 for v in values):
            return w
    return 1


class RowCopies:
    """One launch per word size for a fixed set of (contiguous out, strided src) pairs on
    one CUDA device. The pairs' memory must stay where it is while this lives."""

    def __init__(self, groups: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        # (job table, a tensor of the word's dtype, the widest run in words, the most runs)
        self.groups = groups

    @staticmethod
    def accepts(out: torch.Tensor, src: torch.Tensor) -> bool:
        runs = runs_of(src)
        return (
            runs is not None
            and runs.length * src.element_size() >= MIN_RUN_BYTES
            and src.is_cuda
            and out.device == src.device
            and out.dtype == src.dtype
            and out.is_contiguous()
        )

    @classmethod
    def build(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> RowCopies | None:
        """Copies for `pairs` (each `accepts`), run once now; None if the kernel is
        unavailable (they are left uncopied then)."""
        global _kernel_failure_logged
        by_word: dict[int, list[tuple[int, ...]]] = {}
        for out, src in pairs:
            runs = runs_of(src)
            assert runs is not None
            size = src.element_size()
            row, step = runs.length * size, runs.stride * size
            w = _word(row, step, src.data_ptr(), out.data_ptr())
            job = (src.data_ptr(), out.data_ptr(), runs.count, row // w, step // w)
            by_word.setdefault(w, []).append(job)
        device = pairs[0][1].device
        groups = []
        for w, jobs in by_word.items():
            table = torch.tensor(jobs, dtype=torch.int64, device=device)
            typed = torch.empty(1, dtype=_WORDS[w], device=device)
            groups.append((table, typed, max(j[3] for j in jobs), max(j[2] for j in jobs)))
        copies = cls(groups)
        try:
            copies.run()
        except Exception as exc:  # no Triton, or no compiler for this GPU
            if not _kernel_failure_logged:
                _kernel_failure_logged = True
                log.warning(
                    "strided pack copies run one by one: no row-copy kernel", error=str(exc)
                )
            return None
        return copies

    def run(self) -> None:
        """Queue the copies on the current stream (capturable in a CUDA graph)."""
        from .rowcopy_kernel import launch

        for table, typed, widest, most_runs in self.groups:
            launch(table, typed, widest, most_runs)
