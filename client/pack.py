"""Running a bucket's pack ops: this rank's tensors into the staging bytes, in the
engine's layout. Slices, casts and FP8 block quantization (`fp8`), on the tensors' device.

An FP8 destination has two pack ops over the same box: the codes (`Fp8BlockQuant`) and
the scales (`Fp8BlockScale`). One quantization pass gives both, so a `Packer` keeps the
half not asked for yet until its op comes, then forgets it. `clear()` drops whatever is
left (call it per bucket or per version).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy, Fp8BlockQuant, Fp8BlockScale

from .dtypes import TORCH
from .fp8 import quantize_blocks


def box_of(t: torch.Tensor, op: PackOp) -> torch.Tensor:
    return slice_box(t, op.box)


def slice_box(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


class Packer:
    """Runs pack ops; shares one FP8 quantization between the codes and scales of a box.

    A cached half is found again only for the same tensor object, unchanged since (torch's
    in-place version counter is part of the key), the same box and the same block size.
    At most `max_entries` halves wait at once (oldest dropped first).
    """

    def __init__(self, max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._cache: dict[tuple[Any, ...], _Entry] = {}
        self._buckets: dict[tuple[Any, ...], _BucketPlan] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def pack_bucket(
        self, ops: tuple[PackOp, ...], tensors: dict[str, torch.Tensor], staging: torch.Tensor
    ) -> None:
        """A bucket's ops: plain copies and casts in a few multi-tensor copies, FP8 boxes of
        one shape quantized together (stacked).

        The views of the copies are made once per (bucket, tensors, staging) and reused, so
        a version costs a few kernel launches per bucket, not Python work per tensor. The
        copies are grouped by dtypes and by whether the source is contiguous: torch copies a
        group of contiguous pairs in one fused kernel, and falls back to one copy per pair
        for the whole group if any pair is strided.
        """
        key = (id(ops), staging.data_ptr(), *(id(tensors[op.source]) for op in ops))
        plan = self._buckets.get(key)
        if plan is None:
            plan = self._buckets[key] = _bucket_plan(ops, tensors, staging)
            while len(self._buckets) > 4096:
                del self._buckets[next(iter(self._buckets))]
        for outs, srcs in plan.copies:
            torch._foreach_copy_(outs, srcs)
        for group in plan.fp8:
            group.run()
        for op in plan.rest:
            self.pack(op, tensors[op.source], staging)
        self.clear()

    def pack(self, op: PackOp, local: torch.Tensor, staging: torch.Tensor) -> None:
        """Write op's bytes into `staging` (a flat uint8 tensor on any device)."""
        out = staging[op.staging_offset : op.staging_offset + op.nbytes]
        match op.transform:
            case Copy():
                src = box_of(local, op)
                out.view(src.dtype).view(src.shape).copy_(src)
            case Cast(dtype=dtype):
                src = box_of(local, op)
                out.view(TORCH[dtype]).view(src.shape).copy_(src)
            case Fp8BlockQuant(block=block):
                codes = self._fp8(op.source, op.box, block, local, want="codes")
                out.view(codes.dtype).view(codes.shape).copy_(codes)
            case Fp8BlockScale(block=block):
                scales = self._fp8(op.source, op.box, block, local, want="scales")
                out.view(torch.float32).view(scales.shape).copy_(scales)
            case other:
                raise ValueError(f"no pack for transform {type(other).__name__}")

    def _fp8(
        self, source: str, box: Box, block: int, local: torch.Tensor, want: str
    ) -> torch.Tensor:
        key = (source, box, block, id(local), local._version, local.data_ptr())
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and want in entry.parts and entry.tensor is local:
                part = entry.parts.pop(want)
                if not entry.parts:
                    del self._cache[key]
                return part
        codes, scales = quantize_blocks(slice_box(local, box), block)
        other = "scales" if want == "codes" else "codes"
        with self._lock:
            self._cache[key] = _Entry(local, {other: scales if other == "scales" else codes})
            while len(self._cache) > self.max_entries:
                del self._cache[next(iter(self._cache))]
        return codes if want == "codes" else scales


class _Fp8Group:
    """FP8 boxes of one shape, block size and dtype: stacked, quantized in one pass, and
    their codes and scales copied into staging in two multi-tensor copies."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.srcs: list[torch.Tensor] = []
        self.codes: list[torch.Tensor | None] = []  # staging views (None: not asked for)
        self.scales: list[torch.Tensor | None] = []

    def run(self) -> None:
        codes, scales = quantize_blocks(torch.stack(self.srcs), self.block)
        for wanted, got in ((self.codes, codes), (self.scales, scales)):
            pairs = [(out, got[i]) for i, out in enumerate(wanted) if out is not None]
            if pairs:
                torch._foreach_copy_([o for o, _ in pairs], [g for _, g in pairs])


class _BucketPlan:
    __slots__ = ("copies", "fp8", "rest")

    def __init__(self) -> None:
        self.copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.fp8: list[_Fp8Group] = []
        self.rest: list[PackOp] = []


def _bucket_plan(
    ops: tuple[PackOp, ...], tensors: dict[str, torch.Tensor], staging: torch.Tensor
) -> _BucketPlan:
    plan = _BucketPlan()
    copies: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    fp8: dict[tuple[Any, ...], _Fp8Group] = {}
    fp8_at: dict[tuple[Any, ...], tuple[_Fp8Group, int]] = {}  # (source, box, block) -> slot
    for op in ops:
        out = staging[op.staging_offset : op.staging_offset + op.nbytes]
        match op.transform:
            case Copy() | Cast():
                src = box_of(tensors[op.source], op)
                dtype = src.dtype if isinstance(op.transform, Copy) else TORCH[op.transform.dtype]
                outs, srcs = copies.setdefault((src.dtype, dtype, src.is_contiguous()), ([], []))
                outs.append(out.view(dtype).view(src.shape))
                srcs.append(src)
            case Fp8BlockQuant(block=block) | Fp8BlockScale(block=block):
                src = box_of(tensors[op.source], op)
                if src.dim() != 2 or not src.is_floating_point():
                    plan.rest.append(op)  # quantize_blocks names what is wrong with it
                    continue
                at = fp8_at.get((op.source, op.box, block))
                if at is None:
                    group = fp8.setdefault((block, src.dtype, tuple(src.shape)), _Fp8Group(block))
                    group.srcs.append(src)
                    group.codes.append(None)
                    group.scales.append(None)
                    at = fp8_at[(op.source, op.box, block)] = (group, len(group.srcs) - 1)
                group, i = at
                if isinstance(op.transform, Fp8BlockQuant):
                    group.codes[i] = out.view(torch.float8_e4m3fn).view(src.shape)
                else:
                    tiles = (-(-src.shape[0] // block), -(-src.shape[1] // block))
                    group.scales[i] = out.view(torch.float32).view(tiles)
            case _:
                plan.rest.append(op)
    plan.copies = list(copies.values())
    plan.fp8 = list(fp8.values())
    return plan


class _Entry:
    __slots__ = ("parts", "tensor")

    def __init__(self, tensor: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        self.tensor = tensor  # held so that its id cannot be reused while the entry lives
        self.parts = parts


_default = Packer()


def pack(op: PackOp, local: torch.Tensor, staging: torch.Tensor) -> None:
    """Write op's bytes into `staging`, through a process-wide `Packer`."""
    _default.pack(op, local, staging)


def clear() -> None:
    """Forget the process-wide Packer's waiting FP8 halves."""
    _default.clear()
