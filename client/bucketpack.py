"""One bucket's bytes on a trainer rank, and its delta: packed straight into its
destinations (colocated, `direct`), or into its ring slot of staging, or (host staging
with delta sync) compared in place first and packed only where staging is still read."""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightwire.protocol.plan import Bucket, RankPlan, StagingRing

from .delta.inplace import needs_staging
from .delta.sender import DeltaSender
from .delta.trailers import SourceBytes
from .direct import Target
from .pack import Packer
from .ring import SlotOps


class BucketPacking:
    """The rank's packer and its delta sender, as each bucket uses them."""

    def __init__(
        self, packer: Packer, slot_ops: SlotOps, delta: DeltaSender, host_bytes: SourceBytes
    ) -> None:
        self._packer, self._slot_ops = packer, slot_ops
        self._delta, self._host_bytes = delta, host_bytes

    def pack(
        self,
        plan: RankPlan,
        ring: StagingRing,
        bucket: Bucket,
        direct: list[Target] | None,
        current: dict[str, torch.Tensor],
        staging: torch.Tensor | None,
        out: torch.Tensor | None,
        gpu_regions: Callable[[str, int], bool],
    ) -> list[tuple[int, int, int]]:
        """Pack `bucket` (queued on the current stream for GPU tensors); its delta
        payloads, as `DeltaSender.bucket`."""
        unpacked = None  # compared in place, packed only if staging is read
        if direct:  # colocated: packing is the transfer
            for region, ops in direct:
                self._packer.pack_bucket(ops, current, region)
        elif bucket.packs:
            assert staging is not None
            ops = self._slot_ops.of(plan, ring, bucket)
            unpacked = self._delta.in_place(bucket, staging, current)
            if unpacked is None:
                self._packer.pack_bucket(ops, current, staging)
        delta = self._delta.bucket(
            bucket,
            staging,
            ring.shift[bucket.index],
            out,
            self._host_bytes,
            gpu_regions,
            unpacked,
        )
        if unpacked is not None and needs_staging(bucket, delta):
            assert staging is not None  # `in_place` gives None without it
            self._packer.pack_bucket(ops, current, staging)
        return delta


def gpu_regions_of(plan: RankPlan) -> Callable[[str, int], bool]:
    """Whether the plan's (node, region) is GPU memory (a range written there is checksummed
    as the engine will, `digest.range_digest`): looked up once per version, not per bucket."""
    kinds = {(r.node, r.id): r.kind for r in plan.regions}
    return lambda node, region: kinds.get((node, region)) == "gpu"
