"""A bucket's pack ops made once into batched work and run every version.

Plain copies (same dtype, contiguous source) go, where Triton runs, through one launch of
`copy_kernel` per bucket. Casts and the rest are grouped by dtypes and by whether the
source is contiguous: torch copies a group of contiguous pairs in one fused kernel, and
falls back to one copy per pair for the whole group if any pair is strided. FP8 boxes
of one shape, block size and dtype are stacked and quantized in one pass, or, where Triton
runs (`fp8_kernel`), every FP8 box of the bucket goes through one kernel launch per source
dtype (and alignment class) that writes codes and scales straight into staging. On the
GPU the copies (thousands of small strided ones for a layer of experts) and those launches
are captured once as a CUDA graph, so a version replays them with one launch per bucket
instead of one per copy.
"""

from __future__ import annotations

import contextlib
import gc
import math
import operator
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy, Fp8BlockQuant, Fp8BlockScale

from . import copy_kernel, fp8_kernel
from .copy_kernel import CopyBatch
from .dtypes import TORCH
from .fp8 import quantize_blocks
from .fp8_kernel import Fp8Batch, Fp8Box
from .streams import own_stream

log = structlog.get_logger("weightwire.client.pack")

GRAPHS = os.environ.get("WEIGHTWIRE_PACK_GRAPHS", "1") != "0"
_data_ptr = torch.Tensor.data_ptr
_graph_failure_logged = False
_kernel_failed = False  # the FP8 kernel failed once in this process: the torch path only
_copy_failed = False  # the copy kernel failed once in this process: torch's copies only
_capture_lock = threading.Lock()
"""One graph capture at a time in this process: two ranks' threads capturing at once
segfaulted inside torch's `capture_begin` (once, in test_pack_streams). A capture is made
once per bucket and plan, never per version, so they rarely wait on each other."""


def box_of(t: torch.Tensor, op: PackOp) -> torch.Tensor:
    return slice_box(t, op.box)


def slice_box(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The box of a local tensor: a view; for a merged-rows tensor (`merged`), a copy."""
    if merged(t, box):
        rest = tuple(box.sizes[1:])
        return torch.cat([part.reshape(-1, *rest) for _, part in row_parts(t, box)])
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


def merged(t: torch.Tensor, box: Box) -> bool:
    """Whether `t` stands for a tensor of one dimension less, its dims 0 and 1 being that
    tensor's rows (Megatron's interleaved QKV: (groups, rows per group, ...), the view
    stepping over the other heads of each group)."""
    return t.dim() == len(box.sizes) + 1


def row_parts(t: torch.Tensor, box: Box) -> list[tuple[int, torch.Tensor]]:
    """A box of a merged-rows tensor as views, each with its first row in the box: whole
    groups as one view, partial groups on their own."""
    per = t.shape[1]
    rest: tuple[slice, ...] = tuple(
        slice(o, o + s) for o, s in zip(box.offsets[1:], box.sizes[1:], strict=True)
    )
    start, end = box.offsets[0], box.offsets[0] + box.sizes[0]
    out = []
    row = start
    while row < end:
        g, i = divmod(row, per)
        if i == 0 and end - row >= per:
            n = (end - row) // per
            out.append((row - start, t[(slice(g, g + n), slice(None), *rest)]))
            row += n * per
        else:
            stop = min(end, (g + 1) * per)
            index: tuple[int | slice, ...] = (g, slice(i, i + stop - row), *rest)
            out.append((row - start, t[index]))
            row = stop
    return out


def merged_copies(
    t: torch.Tensor, box: Box, out: torch.Tensor, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(staging view, source view) pairs that copy a merged-rows box into `out` (its bytes
    in `dtype`, row-major)."""
    row_bytes = math.prod(box.sizes[1:]) * torch.empty((), dtype=dtype).element_size()
    pairs = []
    for row, part in row_parts(t, box):
        n = part.numel() // max(1, math.prod(box.sizes[1:]))
        dst = out[row * row_bytes : (row + n) * row_bytes].view(dtype).view(part.shape)
        pairs.append((dst, part))
    return pairs


class Fp8Group:
    """FP8 boxes of one shape, block size and dtype: stacked, quantized in one pass, and
    their codes and scales copied into staging in two multi-tensor copies."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.srcs: list[torch.Tensor] = []
        self.codes: list[torch.Tensor | None] = []  # staging views (None: not asked for)
        self.scales: list[torch.Tensor | None] = []

    def boxes(self, staging: torch.Tensor) -> list[Fp8Box]:
        """The group's boxes as the kernel takes them (offsets into `staging`)."""
        base = staging.data_ptr()
        return [
            Fp8Box(
                src,
                codes.data_ptr() - base if codes is not None else -1,
                scales.data_ptr() - base if scales is not None else -1,
            )
            for src, codes, scales in zip(self.srcs, self.codes, self.scales, strict=True)
        ]

    def run(self) -> None:
        codes, scales = quantize_blocks(torch.stack(self.srcs), self.block)
        for wanted, got in ((self.codes, codes), (self.scales, scales)):
            pairs = [(out, got[i]) for i, out in enumerate(wanted) if out is not None]
            if pairs:
                torch._foreach_copy_([o for o, _ in pairs], [g for _, g in pairs])


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection inside a graph capture: a CUDA graph collected then (of a
    bucket pack dropped earlier) is destroyed inside the capture, which CUDA forbids
    ("operation not permitted when stream is capturing"), and the capture fails."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class BucketPack:
    """One bucket's ops over given tensors and staging, batched. `rest` are the ops it
    leaves to the caller (transforms it does not batch)."""

    def __init__(
        self,
        ops: tuple[PackOp, ...],
        tensors: dict[str, torch.Tensor],
        staging: torch.Tensor,
        graphs: bool = True,
        capture_stream: Callable[[torch.device], torch.cuda.Stream] | None = None,
    ) -> None:
        """`capture_stream`: the stream the graph is captured on, the caller's alone (see
        `streams`); None: one made for this bucket."""
        self.ops = ops  # held: its id keys the cache and must not be reused meanwhile
        self.names = tuple(dict.fromkeys(op.source for op in ops))
        self.staging_ptr = staging.data_ptr()
        self._objs = [tensors[n] for n in self.names]  # held: their ids cannot be reused
        self._ptrs = list(map(_data_ptr, self._objs))
        self.copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.fp8: list[Fp8Group] = []  # quantized by torch, stacked by shape
        self.kernel: list[Fp8Batch] = []  # quantized by the kernel, one launch each
        self.plain: CopyBatch | None = None  # same-dtype contiguous copies, one launch
        self.rest: list[PackOp] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self._graphs = graphs and GRAPHS and staging.is_cuda
        self._device = staging.device
        self._capture_stream = capture_stream
        self._build(tensors, staging)

    def fits(
        self, ops: tuple[PackOp, ...], tensors: dict[str, torch.Tensor], staging: torch.Tensor
    ) -> bool:
        """Whether this was made for these ops, tensors (same objects, same storage) and
        staging: its views, and the graph's pointers, are valid for them. Once per bucket
        and version over the bucket's tensors, so in C loops (`map`), not Python ones: a
        generator over 5000 tensors took 1-3 ms of a version's host time."""
        return (
            ops is self.ops
            and staging.data_ptr() == self.staging_ptr
            and all(map(operator.is_, map(tensors.__getitem__, self.names), self._objs))
            and list(map(_data_ptr, self._objs)) == self._ptrs
        )

    def run(self) -> None:
        """Queue the batched ops on the current stream (the graph from the second run on)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run_plain()
            for outs, srcs in self.copies:
                torch._foreach_copy_(outs, srcs)
            self._run_kernel()
            if self._graphs and (self.copies or self.kernel or self.plain):
                self.graph = self._capture()
                self._graphs = False
        for group in self.fp8:
            group.run()

    def _run_plain(self) -> None:
        """The copy kernel, eagerly (the first run compiles it). If it fails its pairs go
        to torch's copies, for this bucket and every later one."""
        global _copy_failed
        if self.plain is None:
            return
        try:
            self.plain.run()
        except Exception as exc:
            if not _copy_failed:
                log.warning(
                    "pack copies run through torch: the copy kernel failed", error=repr(exc)
                )
            _copy_failed = True
            outs = [dst.view(src.dtype).view(src.shape) for src, dst in self.plain.pairs]
            srcs = [src for src, _ in self.plain.pairs]
            self.plain = None
            self.copies.append((outs, srcs))
            torch._foreach_copy_(outs, srcs)

    def _run_kernel(self) -> None:
        """The FP8 launches, eagerly (the first run compiles them). A kernel that fails
        hands its boxes to the torch path, for this bucket and every later one."""
        global _kernel_failed
        try:
            for batch in self.kernel:
                batch.run()
        except Exception as exc:
            if not _kernel_failed:
                log.warning(
                    "FP8 packs run through torch: the Triton kernel failed", error=repr(exc)
                )
            _kernel_failed = True
            self.fp8 += self._kernel_groups
            self.kernel = []

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        global _graph_failure_logged
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self._device)
        # Captured on a stream no one else has (never torch's pool, whose streams come
        # round again every 32 draws: another rank's packing stream there would have its
        # packs captured into this graph instead of run, and its waits on events recorded
        # outside the capture would invalidate it). The capture is this thread's only
        # (thread_local): other threads may use their own streams meanwhile.
        make = self._capture_stream or own_stream
        side = make(self._device)
        side.wait_stream(current)
        try:
            with _capture_lock, _no_collection(), torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if self.plain is not None:
                        self.plain.run()
                    for outs, srcs in self.copies:
                        torch._foreach_copy_(outs, srcs)
                    for batch in self.kernel:
                        batch.run()
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            if not _graph_failure_logged:
                _graph_failure_logged = True
                log.warning("pack copies run eagerly: CUDA graph capture failed", error=str(exc))
            return None
        finally:
            current.wait_stream(side)
        return graph

    def _build(self, tensors: dict[str, torch.Tensor], staging: torch.Tensor) -> None:
        copies: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        fp8: dict[tuple[Any, ...], Fp8Group] = {}
        fp8_at: dict[tuple[Any, ...], tuple[Fp8Group, int]] = {}  # (source, box, block) -> slot
        plain: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, staging bytes)
        kernel_copies = not _copy_failed and copy_kernel.available([staging])
        for op in self.ops:
            out = staging[op.staging_offset : op.staging_offset + op.nbytes]
            match op.transform:
                case Copy() | Cast() if merged(tensors[op.source], op.box):
                    local = tensors[op.source]
                    dtype = (
                        local.dtype if isinstance(op.transform, Copy) else TORCH[op.transform.dtype]
                    )
                    for dst, part in merged_copies(local, op.box, out, dtype):
                        outs, srcs = copies.setdefault((local.dtype, dtype, False), ([], []))
                        outs.append(dst)
                        srcs.append(part)
                case Fp8BlockQuant() | Fp8BlockScale() if merged(tensors[op.source], op.box):
                    self.rest.append(op)  # packed from a fresh copy of its rows each time
                case Copy() | Cast():
                    src = box_of(tensors[op.source], op)
                    dtype = (
                        src.dtype if isinstance(op.transform, Copy) else TORCH[op.transform.dtype]
                    )
                    key = (src.dtype, dtype, src.is_contiguous())
                    if (
                        kernel_copies
                        and key == (dtype, dtype, True)
                        and src.device == staging.device
                    ):
                        plain.append((src, out))
                        continue
                    outs, srcs = copies.setdefault(key, ([], []))
                    outs.append(out.view(dtype).view(src.shape))
                    srcs.append(src)
                case Fp8BlockQuant(block=block) | Fp8BlockScale(block=block):
                    src = box_of(tensors[op.source], op)
                    if src.dim() != 2 or not src.is_floating_point():
                        self.rest.append(op)  # quantize_blocks names what is wrong with it
                        continue
                    quant = isinstance(op.transform, Fp8BlockQuant)
                    at = fp8_at.get((op.source, op.box, block))
                    if (
                        at is not None
                        and (at[0].codes if quant else at[0].scales)[at[1]] is not None
                    ):
                        at = None  # the box again, to another destination: an entry of its own
                    if at is None:
                        group = fp8.setdefault(
                            (block, src.dtype, tuple(src.shape)), Fp8Group(block)
                        )
                        group.srcs.append(src)
                        group.codes.append(None)
                        group.scales.append(None)
                        at = fp8_at[(op.source, op.box, block)] = (group, len(group.srcs) - 1)
                    group, i = at
                    if quant:
                        group.codes[i] = out.view(torch.float8_e4m3fn).view(src.shape)
                    else:
                        tiles = (-(-src.shape[0] // block), -(-src.shape[1] // block))
                        group.scales[i] = out.view(torch.float32).view(tiles)
                case _:
                    self.rest.append(op)
        self.copies = list(copies.values())
        if plain:
            self.plain = CopyBatch(plain)
        self._kernel_groups: list[Fp8Group] = []
        by_kind: dict[tuple[int, torch.dtype], list[Fp8Box]] = {}
        for (block, dtype, _), group in fp8.items():
            usable = dtype in fp8_kernel.DTYPES and not _kernel_failed
            if not usable or not fp8_kernel.available([staging, *group.srcs], block):
                self.fp8.append(group)
                continue
            self._kernel_groups.append(group)
            by_kind.setdefault((block, dtype), []).extend(group.boxes(staging))
        self.kernel = [Fp8Batch(boxes, staging, block) for (block, _), boxes in by_kind.items()]
