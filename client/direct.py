"""Colocated packing: buckets a trainer rank packs straight into its engines' memory.

When every write of a bucket goes from staging into GPU memory of the GPU the rank packs
on (an engine on the same GPU, `--place 0:0`), packing is the transfer: the bucket's pack
ops are moved from their staging offsets to where their bytes land, in each destination
region (its CUDA IPC handle opened once in this process; an engine of this very process:
its memory as it is), and packed there; no staging hop, no copy. The rank then waits for
the packing, as for any bucket, and tells the daemon the bucket is packed in place; the
daemon delivers the writes' immediates, so each engine still counts exactly its planned
immediates, after the bytes are visible.

A bucket qualifies only if every write is from staging to a region on this GPU, every pack
op lies inside one block of one write (or of consecutive writes that continue each other
at both ends: a piece cut at max_write_bytes), and the ops cover every block byte for byte
(a block written to several engine ranks: the op is packed into each); and not in
delta-capable plans (those compare and checksum staging). Anything else goes through
staging as before. A region whose handle cannot be opened here keeps its buckets on the
staging path.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
from typing import Any

import msgspec
import structlog
import torch

from weightwire.memory.cudadrv import CudaError, driver
from weightwire.protocol.plan import Bucket, PackOp, RankPlan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import Fp8BlockQuant, Fp8BlockScale

from .cuda import EXPORTED, gpu_uuid

log = structlog.get_logger("weightwire.client.direct")

Descs = dict[tuple[str, int], RegionDescriptor]
"""A plan's regions by (node, id), made once per plan."""

Target = tuple[torch.Tensor, tuple[PackOp, ...]]
"""A destination region's bytes (as a flat uint8 tensor) and the ops packed into it."""


def device_uuid(device: torch.device) -> str:
    return gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())


class _Mem:
    """Device memory at a raw pointer, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class Direct:
    """Per plan: which buckets this rank packs in place, and their moved ops (made once)."""

    def __init__(self) -> None:
        self._plan: RankPlan | None = None  # the last plan seen (its object)
        self._key: tuple[str, tuple[RegionDescriptor, ...]] = ("", ())
        self._targets: dict[int, list[Target] | None] = {}
        self._regions: dict[tuple[str, int], torch.Tensor | None] = {}
        self._opened: dict[bytes, int] = {}  # IPC handle -> base here

    def targets(self, plan: RankPlan, bucket: Bucket, device: torch.device) -> list[Target] | None:
        """Where bucket's ops go when it is packed in place, or None: through staging."""
        if device.type != "cuda" or plan.trailers or bucket.deltas or not bucket.packs:
            return None
        if plan is not self._plan:
            # The plan's hash is of its layout only: an engine restarted with the same
            # layout comes back under the same hash in new memory (new IPC handles), so
            # the regions (their keys) are part of what the targets were made for.
            self._plan = plan
            key = (plan.plan_hash, plan.regions)
            if key != self._key:
                self._release(plan, device)
                self._key, self._targets, self._regions = key, {}, {}
        if not self._targets:
            self._targets = self._make_all(plan, device)
        return self._targets.get(bucket.index)

    def _make_all(self, plan: RankPlan, device: torch.device) -> dict[int, list[Target] | None]:
        """Every bucket's targets, once per plan, FP8 scales hoisted (`hoist_scales`). A
        bucket with a region not mapped here goes through staging, which packs its planned
        ops only: it is left out before hoisting, so that no scales move into it (they
        would be packed nowhere while their own bucket's immediates are delivered)."""
        descs = {(r.node, r.id): r for r in plan.regions}
        moved: dict[int, dict[tuple[str, int], list[PackOp]] | None] = {}
        for b in plan.buckets:
            m = self._moved(b, descs, device) if b.packs and not b.deltas else None
            if m is not None and any(self._region(descs[r], device) is None for r in m):
                m = None
            moved[b.index] = m
        hoist_scales(moved)
        return {i: None if m is None else self._finish(m, descs, device) for i, m in moved.items()}

    def _make(self, plan: RankPlan, bucket: Bucket, device: torch.device) -> list[Target] | None:
        """One bucket's targets on its own (no scales hoisted into it)."""
        descs = {(r.node, r.id): r for r in plan.regions}
        moved = self._moved(bucket, descs, device)
        return None if moved is None else self._finish(moved, descs, device)

    def _finish(
        self, moved: dict[tuple[str, int], list[PackOp]], regions: Descs, device: torch.device
    ) -> list[Target] | None:
        out: list[Target] = []
        for region, ops in moved.items():
            if not ops:
                continue
            mem = self._region(regions[region], device)
            if mem is None:
                return None
            out.append((mem, tuple(ops)))
        return _one_target(out, device)

    def _moved(
        self, bucket: Bucket, regions: Descs, device: torch.device
    ) -> dict[tuple[str, int], list[PackOp]] | None:
        """The bucket's ops moved to their destination regions' offsets, or None."""
        uuid = device_uuid(device)
        blocks: list[tuple[int, int, tuple[str, int], int]] = []  # (src, length, dst, offset)
        for w in bucket.writes:
            desc = regions.get((w.dst_node, w.dst_region))
            key = desc.keys.cuda if desc is not None else None
            if w.src_region != -1 or key is None or key.device_uuid != uuid:
                return None
            for src, dst in w.blocks():
                blocks.append((src, w.length, (w.dst_node, w.dst_region), dst))
        per: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # region: (src, n, dst)
        for src, n, region, dst in _merged(blocks):
            per.setdefault(region, []).append((src, n, dst))
        starts = {region: [b[0] for b in bs] for region, bs in per.items()}
        covered = {region: [0] * len(bs) for region, bs in per.items()}
        moved: dict[tuple[str, int], list[PackOp]] = {}
        for op in bucket.packs:
            lo, hi, landed = op.staging_offset, op.staging_offset + op.nbytes, False
            for region, bs in per.items():
                i = bisect.bisect_right(starts[region], lo) - 1
                if i >= 0 and hi <= bs[i][0] + bs[i][1]:  # inside block i: packed there
                    src, _, dst = bs[i]
                    covered[region][i] += op.nbytes
                    at = dst + lo - src
                    moved.setdefault(region, []).append(
                        msgspec.structs.replace(op, staging_offset=at)
                    )
                    landed = True
                elif (i >= 0 and bs[i][0] + bs[i][1] > lo) or (
                    i + 1 < len(bs) and bs[i + 1][0] < hi
                ):
                    return None  # a block holds part of the op only
            if not landed:
                return None
        for region, bs in per.items():
            if any(c != b[1] for c, b in zip(covered[region], bs, strict=True)):
                return None
        return moved

    def _region(self, desc: RegionDescriptor, device: torch.device) -> torch.Tensor | None:
        """The destination region's bytes, mapped into this process once."""
        at = (desc.node, desc.id)
        if at not in self._regions:
            key = desc.keys.cuda
            if key is None:  # VMM memory: only its own daemon maps it (README, memory saver)
                self._regions[at] = None
                return None
            base = self._opened.get(key.ipc_handle) or EXPORTED.get(key.ipc_handle)
            if base is None:
                drv = driver()
                drv.use(device.index if device.index is not None else torch.cuda.current_device())
                try:
                    base = drv.ipc_open(key.ipc_handle)
                except CudaError as exc:
                    log.info("colocated region not mapped; packing through staging",
                             region=desc.id, node=desc.node, error=exc.message)  # fmt: skip
                    self._regions[at] = None
                    return None
                self._opened[key.ipc_handle] = base
            self._regions[at] = _span(base + key.offset, desc.length, device)
        return self._regions[at]

    def _release(self, plan: RankPlan, device: torch.device) -> None:
        """Close the mappings of engine memory the new plan no longer names (an engine gone,
        or back in new memory): each keeps that memory allocated on this GPU for as long as
        it is open, so elastic churn would pile them up. Packs already queued may still write
        through them: the device is synchronized first (a replan, not a version's path)."""
        live = {r.keys.cuda.ipc_handle for r in plan.regions if r.keys.cuda is not None}
        stale = [h for h in self._opened if h not in live]
        if not stale:
            return
        torch.cuda.synchronize(device)
        drv = driver()
        for handle in stale:
            base = self._opened.pop(handle)
            with contextlib.suppress(CudaError):
                drv.ipc_close(base)
        log.info("closed mappings of engine memory no longer planned", count=len(stale))

    def close(self) -> None:
        self._regions.clear()
        self._targets.clear()
        drv = driver() if self._opened else None
        for base in self._opened.values():
            with contextlib.suppress(CudaError):
                assert drv is not None
                drv.ipc_close(base)
        self._opened.clear()


def hoist_scales(moved: dict[int, dict[tuple[str, int], list[PackOp]] | None]) -> None:
    """FP8 scales packed with their codes. A box's codes and scales are separate ops, and
    a plan lays out every codes region before its scales region, so the scales of a
    bucket's boxes often fall in a later bucket, whose pack would read each source tile
    again (32 KiB of bf16 for 4 bytes of scale: 0.4-0.6 ms for such a bucket of 267 MB,
    against 0.3 ms for codes with their scales, on an H100). Each such scale op moves
    (in place, in bucket order) to the bucket of its codes, whose kernel then writes the
    codes and the scales of each tile in one read: the bytes land earlier, never later,
    than the later bucket's immediates say. A bucket keeps at least one op."""
    quant: dict[tuple[str, Any, int], int] = {}
    for index, regions in sorted(moved.items()):
        if regions is None:
            continue
        for region, ops in regions.items():
            keep: list[PackOp] = []
            left = sum(map(len, regions.values()))
            for op in ops:
                t = op.transform
                key = (op.source, op.box, getattr(t, "block", 0))
                if isinstance(t, Fp8BlockQuant):
                    quant.setdefault(key, index)
                home = quant.get(key, index) if isinstance(t, Fp8BlockScale) else index
                target = moved.get(home)
                if home < index and target is not None and left > 1:
                    target.setdefault(region, []).append(op)
                    left -= 1
                else:
                    keep.append(op)
            regions[region] = keep


def _one_target(targets: list[Target], device: torch.device) -> list[Target]:
    """Targets in several regions as one: the bytes from the lowest region's start to the
    highest one's end (one virtual range of this GPU's address space, touched only at the
    ops' offsets), the ops moved to their offsets in it. The bucket is then packed by one
    batch (one copy launch, one FP8 launch per dtype, one CUDA graph), not one per region:
    an engine whose parameters are separate allocations gives a bucket dozens of them."""
    if len(targets) < 2:
        return targets
    lo = min(mem.data_ptr() for mem, _ in targets)
    hi = max(mem.data_ptr() + mem.numel() for mem, _ in targets)
    span = _span(lo, hi - lo, device)
    ops = tuple(
        msgspec.structs.replace(op, staging_offset=op.staging_offset + mem.data_ptr() - lo)
        for mem, moved in targets
        for op in moved
    )
    return [(span, ops)]


def _span(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over `nbytes` at `ptr` (GPU memory; host memory in the tests)."""
    if device.type == "cuda":
        return torch.as_tensor(_Mem(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _merged(
    blocks: list[tuple[int, int, tuple[str, int], int]],
) -> list[tuple[int, int, tuple[str, int], int]]:
    """Blocks into one region that continue each other at both ends as one: a pack op cut
    into several writes (max_write_bytes) lies inside one again."""
    out: list[tuple[int, int, tuple[str, int], int]] = []
    for src, n, region, dst in sorted(blocks, key=lambda b: (b[2], b[0])):
        if out:
            s0, n0, r0, d0 = out[-1]
            if s0 + n0 == src and r0 == region and d0 + n0 == dst:
                out[-1] = (s0, n0 + n, r0, d0)
                continue
        out.append((src, n, region, dst))
    return out
