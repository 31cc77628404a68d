"""GPU staging's ring-slot counters, written by the daemon (`BeginVersion.fence_offset`).

The rank's packing stream waits on the GPU (cuStreamWaitValue32, GEQ) for slot s's
counter to reach bucket b's sequence number before it packs the slot's next bucket; this
writes that number once every read of bucket b's slot is done: on the GPU right after the
bucket's cuda copies (its stream waits on the lanes' events, then cuStreamWriteValue32),
or when the bucket has landed (any other transport). Each bucket is signalled once, in
order on one stream per device, so a slot's counter only grows. A failed version sets
every counter to its last sequence number: no wait of the rank's is left hanging.

The counters are a few words at the end of the rank's staging allocation, opened here
through its CUDA IPC handle with the staging region itself: registered once, never per
version. No torch: the driver alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from weightwire.memory.cudadrv import CudaError, Driver, driver
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.plan import StagingRing
from weightwire.transport.base import LocalRegion

MASK = 0xFFFFFFFF
NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery's "not yet"
POLL_S = 100e-6
WORD = 4  # bytes per slot counter

STREAMS = 8  # signalling streams per device: ranks spread over them by their counters
_streams: dict[tuple[int, int], int] = {}  # of this process, by (device, which)
_lock = threading.Lock()


def _stream(drv: Driver, device: int, address: int) -> int:
    """The stream that writes the counters at `address`: always the same one for a rank's
    counters (so they only grow), ranks spread over a few (so that one rank's writes,
    queued behind its copies, do not hold back another's)."""
    key = (device, (address // 64) % STREAMS)
    with _lock:
        s = _streams.get(key)
        if s is None:
            drv.use(device)
            s = _streams[key] = drv.stream()
        return s


def _release_stream(drv: Driver, device: int) -> int:
    """A stream per device for releases only: nothing is ever queued on it to wait."""
    with _lock:
        s = _streams.get((device, -1))
        if s is None:
            drv.use(device)
            s = _streams[device, -1] = drv.stream()
        return s


def stream_driver(what: str, op: str) -> Driver:
    """The CUDA driver for `what` ("slot counters need", "a pack counter needs"): PlanError
    where there is none, or (INVALID) where it has no stream memory operations (`op`, the
    one it needs, named)."""
    try:
        drv = driver()
    except CudaError as exc:
        raise PlanError(f"{what} CUDA here: {exc.message}") from None
    if not drv.stream_mem_ops():
        raise PlanError(
            f"this CUDA driver has no stream memory operations ({op})", code=ErrorCode.INVALID
        )
    return drv


async def poll_done(drv: Driver, stream: int, timeout_s: float) -> int:
    """Records an event on `stream` and polls it (at most `timeout_s`): 0 once everything
    queued on `stream` before is done, NOT_READY at the timeout, cuEventQuery's other codes
    as they come."""
    event = drv.event()
    try:
        drv.record(event, stream)
        deadline = time.monotonic() + timeout_s
        while (rc := drv.try_call("cuEventQuery", ctypes.c_void_p(event))) == NOT_READY:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        return rc
    finally:
        drv.destroy_event(event)


def sequence(base: int, bucket: int) -> int:
    """Bucket `bucket`'s sequence number in a version whose base is `base`."""
    return (base + bucket + 1) & MASK


class Counters(Protocol):
    """What the publisher asks of a version's slot counters."""

    def signal(self, bucket: int, after: Sequence[int] = ()) -> None: ...

    def release(self) -> None: ...

    async def settled(self, timeout_s: float) -> bool: ...


class SlotCounters:
    """One version's slot counters: where they are, and what each bucket writes there."""

    def __init__(
        self, staging: LocalRegion | None, ring: StagingRing, offset: int, base: int, buckets: int
    ) -> None:
        """Checks the rank's `fence_offset` against its staging region and the ring;
        PlanError (INVALID) naming what does not fit."""
        if ring.slots <= 0:
            raise PlanError(
                "slot counters need a staging ring (staging_buckets > 0)", code=ErrorCode.INVALID
            )
        if staging is None or staging.kind != "gpu" or staging.device is None:
            raise PlanError(
                "slot counters need GPU staging (the counters live at its end)",
                code=ErrorCode.INVALID,
            )
        end = offset + WORD * ring.slots
        if offset % WORD or offset < ring.nbytes or end > staging.length:
            raise PlanError(
                f"slot counters at offset {offset} ({ring.slots} slots of {WORD} bytes) do not "
                f"fit past the ring's {ring.nbytes} bytes in the {staging.length}-byte staging "
                f"region, aligned to {WORD}",
                code=ErrorCode.INVALID,
            )
        self._drv = stream_driver("slot counters need", "cuStreamWriteValue32_v2")
        self.device = staging.device
        self.address = staging.address + offset
        self.ring = ring
        self.base = base & MASK
        self.buckets = buckets
        self.signalled: set[int] = set()  # buckets whose counter write is queued
        self.released = False

    def signal(self, bucket: int, after: Sequence[int] = ()) -> None:
        """Queue bucket `bucket`'s counter write, after `after` (CUDA events) if any, at
        most once per bucket and never after `release`. CudaError if the driver refuses."""
        slot = self.ring.slot[bucket]
        if slot < 0 or bucket in self.signalled or self.released:
            return
        s = _stream(self._drv, self.device, self.address)
        self._drv.use(self.device)
        for event in after:
            self._drv.stream_wait_event(s, event)
        self._drv.write_value32(s, self.address + WORD * slot, sequence(self.base, bucket))
        self.signalled.add(bucket)

    def release(self) -> None:
        """The version failed: every counter to its last sequence number (after every
        write queued before), so that every wait of the rank's packing stream ends."""
        if self.released:
            return
        self.released = True
        self._drv.use(self.device)
        last = sequence(self.base, self.buckets - 1)
        # First from a stream that waits on nothing, done at once: the signalling stream
        # may wait behind copies that wait (pack counter) for packing that waits for one
        # of these counters. Then after every write queued before (so the counters end
        # at `last`, whatever those write meanwhile).
        free = _release_stream(self._drv, self.device)
        for slot in range(self.ring.slots):
            self._drv.write_value32(free, self.address + WORD * slot, last)
        self._drv.synchronize(free)
        s = _stream(self._drv, self.device, self.address)
        for slot in range(self.ring.slots):
            self._drv.write_value32(s, self.address + WORD * slot, last)

    async def settled(self, timeout_s: float) -> bool:
        """Once every counter write queued so far is done (polled, at most `timeout_s`):
        nothing more is written into the rank's staging. False at the timeout."""
        s = _stream(self._drv, self.device, self.address)
        self._drv.use(self.device)
        return await poll_done(self._drv, s, timeout_s) == 0


MakeCounters = Callable[[LocalRegion | None, StagingRing, int, int, int], Counters]
"""(staging, ring, fence offset, base, buckets) -> a version's counters (SlotCounters)."""
