"""One version's buckets at a trainer rank, in order: each one's ring slot waited for (or
none, packed in place), packed, posted. The publish sequence around it is `Trainer`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from .bucketpack import BucketPacking, gpu_regions_of
from .direct import Direct
from .posting import Poster
from .ring import Landed, slot_wait
from .slotreuse import VersionSlots
from .slotwait import SlotWaits
from .versionstart import Begun


class Packs(Protocol):
    """The trainer rank, as its bucket loop uses it: `_post_bucket` is looked up at each
    version (a subclass or a test may replace it)."""

    _direct: Direct | None
    _packing: BucketPacking
    _slots: SlotWaits

    @property
    def _post_bucket(self) -> Callable[..., None]:
        """(poster, index, device, started, delta, in_place=, queued=)"""


def pack_buckets(
    rank: Packs,
    begun: Begun,
    current: dict[str, torch.Tensor],
    slots: VersionSlots,
    landed: Landed,
    poster: Poster,
) -> tuple[float, bool]:
    """Every bucket of `begun`'s plan packed from `current` and posted, on the current
    stream. Returns the seconds spent packing and posting, and whether every bucket was
    (False: the version failed meanwhile, and its result says why)."""
    direct, packing, waits, post = rank._direct, rank._packing, rank._slots, rank._post_bucket
    plan, staging, device, out = begun.plan, begun.staging, begun.device, begun.out
    ring, gate = begun.ring, begun.gate
    pack_s = 0.0
    in_place: set[int] = set()  # buckets of this version packed in place
    gpu_regions = gpu_regions_of(plan)  # once per version, not per bucket
    for bucket in plan.buckets:
        targets = direct.targets(plan, bucket, device) if direct else None
        reuse = -1 if targets else slot_wait(ring, bucket.index, in_place)
        if gate is not None and landed.ended:
            return pack_s, False  # the version failed: its result says why
        if reuse >= 0 and not slots.free(bucket.index, reuse):
            return pack_s, False  # the version failed: its result says why
        p0 = time.perf_counter()
        started = time.time()
        if targets:  # colocated: packing is the transfer
            in_place.add(bucket.index)
        delta = packing.pack(plan, ring, bucket, targets, current, staging, out, gpu_regions)
        if gate is not None:  # the daemon's copies wait for this on the GPU
            waits.packed(gate, bucket.index)
        post(
            poster,
            bucket.index,
            device,
            started,
            delta,
            in_place=bool(targets),
            queued=gate is not None,
        )
        pack_s += time.perf_counter() - p0
    return pack_s, True
