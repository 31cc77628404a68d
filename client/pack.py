"""Running a bucket's pack ops: this rank's tensors into the staging bytes, in the
engine's layout. Slices, casts and FP8 block quantization (`fp8`), on the tensors' device.

An FP8 destination has two pack ops over the same box: the codes (`Fp8BlockQuant`) and
the scales (`Fp8BlockScale`). One quantization pass gives both, so a `Packer` keeps the
half not asked for yet until its op comes, then forgets it. `clear()` drops whatever is
left (call it per bucket or per version). A whole bucket goes through `pack_bucket`
(batched: see `buckets`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Cast, Copy, Fp8BlockQuant, Fp8BlockScale

from .buckets import BucketPack, box_of, merged, merged_copies, slice_box
from .dtypes import TORCH
from .fp8 import quantize_blocks
from .streams import OwnStreams


class Packer:
    """Runs pack ops; shares one FP8 quantization between the codes and scales of a box.

    A cached half is found again only for the same tensor object, unchanged since (torch's
    in-place version counter is part of the key), the same box and the same block size.
    At most `max_entries` halves wait at once (oldest dropped first).
    """

    def __init__(self, max_entries: int = 8, graphs: bool = True) -> None:
        self.max_entries = max_entries
        self.graphs = graphs  # replay a bucket's copies as a CUDA graph (see BucketPack)
        self._cache: dict[tuple[Any, ...], _Entry] = {}
        self._buckets: dict[int, BucketPack] = {}
        self._lock = threading.Lock()
        # where buckets' graphs are captured: this Packer's own stream per device (a Packer
        # packs from one thread at a time, so no two captures share it)
        self._capture_streams = OwnStreams()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def forget(self) -> None:
        """Drop every bucket made (and its views of the tensors it packed from): the next
        pack of each bucket makes it again."""
        self.clear()
        self._buckets.clear()

    def pack_bucket(
        self, ops: tuple[PackOp, ...], tensors: dict[str, torch.Tensor], staging: torch.Tensor
    ) -> None:
        """A bucket's ops, as a `BucketPack` made on first use and kept while the bucket's
        ops, tensors and staging stay the same objects at the same addresses."""
        entry = self._buckets.get(id(ops))
        if entry is None or not entry.fits(ops, tensors, staging):
            entry = self._buckets[id(ops)] = BucketPack(
                ops, tensors, staging, self.graphs, self._capture_streams.get
            )
            while len(self._buckets) > 4096:
                del self._buckets[next(iter(self._buckets))]
        entry.run()
        for op in entry.rest:
            self.pack(op, tensors[op.source], staging)
        self.clear()

    def pack(self, op: PackOp, local: torch.Tensor, staging: torch.Tensor) -> None:
        """Write op's bytes into `staging` (a flat uint8 tensor on any device)."""
        out = staging[op.staging_offset : op.staging_offset + op.nbytes]
        match op.transform:
            case Copy() | Cast() if merged(local, op.box):
                dtype = local.dtype if isinstance(op.transform, Copy) else TORCH[op.transform.dtype]
                for dst, part in merged_copies(local, op.box, out, dtype):
                    dst.copy_(part)
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
