"""A trainer rank's pack counter (`BeginVersion.gate_offset`): the daemon's copies of a
bucket wait on the GPU for the rank's packing of it, so that the rank posts each bucket
as soon as its packing is queued and no host waits inside the pack -> copy -> slot loop.

The rank's packing stream writes bucket b's sequence number (`slotfence.sequence`) into
one 32-bit word at the end of its staging, right after b's packing; the copies of b from
that GPU wait for it (cuStreamWaitValue32, GEQ: the word only grows, and may wrap) on
their lane's stream before reading staging. A lane's stream runs its posts in the order
they were made, so the publisher posts a rank's gated buckets in bucket order: a later
bucket's copies waiting on its packing, which waits for an earlier bucket's slot counter,
never sit in front of that earlier bucket's copies.

Why not the rank's CUDA IPC events (one per bucket, `cuStreamWaitEvent`): a wait on an
event recorded by another process can only end by that process's GPU work; if the rank
dies with a packing queued behind a slot counter, nothing here can end it, and the lane's
stream (shared by every rank copying from that GPU to that peer) would wait forever. The
counter is memory this daemon has mapped: a failed version (the rank gone, an abort)
writes the version's last sequence number into it from a stream of its own (`release`),
and every copy waiting on it goes ahead (copying what is there: the version has failed).

Copies on a transport that cannot wait on the GPU (tcp, RDMA from GPU staging) wait on
this thread instead (`wait`): a stream of the rank's own waits on the counter, and the
event recorded after is polled, with a timeout.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

from weightwire.memory.cudadrv import CudaError, Driver, driver
from weightwire.protocol.errors import ErrorCode, PlanError, TimeoutError_, VersionError
from weightwire.protocol.plan import RankPlan, StagingRing
from weightwire.transport.base import Gate, LocalRegion

from .slotfence import NOT_READY, WORD, poll_done, sequence, stream_driver

WAIT_S = 300.0  # the longest a bucket waits on the daemon's thread for its packing

_streams: dict[tuple[str, int, int], int] = {}  # of this process: (what, device, address)
_lock = threading.Lock()


def _stream(drv: Driver, what: str, device: int, address: int) -> int:
    """A stream of its own for `what` ("wait", "release") on one rank's counter (made once):
    a host wait for one rank never holds back another's, a release never waits behind
    anything."""
    key = (what, device, address)
    with _lock:
        s = _streams.get(key)
        if s is None:
            drv.use(device)
            s = _streams[key] = drv.stream()
        return s


_supported: bool | None = None


def features() -> tuple[str, ...]:
    """What this daemon tells ranks it does (`Welcome.features`): "pack_gate" where this
    process's CUDA driver has the stream memory operations (checked once)."""
    global _supported
    if _supported is None:
        try:
            _supported = driver().stream_mem_ops()
        except CudaError:
            _supported = False
    return ("pack_gate",) if _supported else ()


class PackGate:
    """One version's pack counter: where it is, and what each bucket waits for."""

    def __init__(
        self,
        staging: LocalRegion | None,
        ring: StagingRing,
        offset: int,
        base: int,
        buckets: int,
        fence: tuple[int, int] = (-1, 0),
    ) -> None:
        """Checks `offset` against the rank's staging region (GPU), the ring's bytes and
        the slot counters (`fence`: their offset and number); PlanError (INVALID) naming
        what does not fit."""
        if staging is None or staging.kind != "gpu" or staging.device is None:
            raise PlanError(
                "a pack counter needs GPU staging (it lives at its end)", code=ErrorCode.INVALID
            )
        start, slots = fence
        overlaps = start >= 0 and offset < start + WORD * slots and start < offset + WORD
        if offset % WORD or offset < ring.nbytes or offset + WORD > staging.length or overlaps:
            raise PlanError(
                f"the pack counter at offset {offset} ({WORD} bytes) does not fit past the "
                f"ring's {ring.nbytes} bytes and its slot counters in the {staging.length}-byte "
                f"staging region, aligned to {WORD}",
                code=ErrorCode.INVALID,
            )
        self._drv = stream_driver("a pack counter needs", "cuStreamWaitValue32_v2")
        self.device = staging.device
        self.address = staging.address + offset
        self.base = base & 0xFFFFFFFF
        self.buckets = buckets
        self.released = False
        self.chain: asyncio.Future[None] | None = None  # the last bucket posted, in order

    def gate(self, bucket: int) -> Gate:
        """What bucket `bucket`'s copies from the staging's GPU wait for."""
        return Gate(self.device, self.address, sequence(self.base, bucket))

    async def wait(self, bucket: int, timeout_s: float) -> None:
        """On this thread: until bucket `bucket` is packed (or the counter released).
        TimeoutError_ after `timeout_s`; CudaError if the driver refuses."""
        drv = self._drv
        s = _stream(drv, "wait", self.device, self.address)
        drv.use(self.device)
        drv.wait_value32(s, self.address, sequence(self.base, bucket))
        rc = await poll_done(drv, s, timeout_s)
        if rc == NOT_READY:
            raise TimeoutError_(
                f"bucket {bucket} was not packed within {timeout_s:.0f} s (its pack counter "
                "never reached it)"
            )
        if rc:
            raise CudaError(f"cuEventQuery failed: {drv.error_name(rc)}")

    def release(self) -> None:
        """The version failed: the counter to its last sequence number, from a stream that
        waits on nothing, and done before this returns (no later version's number can be
        overwritten by it): every copy or host wait on it goes ahead, whatever became of
        the rank."""
        if self.released:
            return
        self.released = True
        drv = self._drv
        s = _stream(drv, "release", self.device, self.address)
        drv.use(self.device)
        drv.write_value32(s, self.address, sequence(self.base, self.buckets - 1))
        drv.synchronize(s)


def check_plan(plan: RankPlan) -> None:
    """PlanError (INVALID) where a plan cannot post buckets before they are packed."""
    if plan.delta_bytes:
        raise PlanError(
            "a pack counter (buckets posted before they are packed) cannot go with delta "
            "payloads, encoded once the packing is done",
            code=ErrorCode.INVALID,
        )


def check_order(version: int, buckets: tuple[int, ...], posted: set[int]) -> None:
    """VersionError (INVALID) unless `buckets` come in order after every one `posted`:
    gated copies waiting on a later bucket's packing would hold back an earlier one's."""
    last = max(posted, default=-1)
    if list(buckets) != sorted(buckets) or buckets[0] <= last:
        raise VersionError(
            f"buckets {list(buckets)} of version {version} posted out of order (after bucket "
            f"{last}): with a pack counter, buckets are posted in order",
            code=ErrorCode.INVALID,
        )


class Gated(Protocol):
    """What the publisher asks of a version's pack counter."""

    chain: asyncio.Future[None] | None

    def gate(self, bucket: int) -> Gate: ...

    async def wait(self, bucket: int, timeout_s: float) -> None: ...

    def release(self) -> None: ...


MakeGate = Callable[[LocalRegion | None, StagingRing, int, int, int, tuple[int, int]], Gated]
"""(staging, ring, gate offset, base, buckets, (fence offset, slots)) -> a version's pack
counter (PackGate)."""
