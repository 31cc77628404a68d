"""What a publish leaves behind it on the trainer side: telling the daemon each bucket is
packed, and the times it reports."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from weightwire.protocol.errors import TimeoutError_
from weightwire.protocol.local import BucketReady, PublishResult, ReplicaOutcome
from weightwire.protocol.plan import RankPlan

from .connection import DaemonConnection
from .ring import Landed

POLL_S = 100e-6  # how often packing events are checked while waiting for a slot


class Poster:
    """Tells the daemon, in order, which buckets are packed, as soon as their CUDA events
    have completed, so that the GPU packs bucket k+1 while the daemon moves bucket k.

    The events are checked, without waiting, each time another bucket has been queued
    for packing, and waited for one by one once every bucket is queued; the buckets found
    packed at one check go in one message. All of it on the publishing thread: a thread
    of its own would wait for the GIL while this one queues packing work, up to a switch
    interval (5 ms) each time an event completes."""

    def __init__(self, conn: DaemonConnection, version: int) -> None:
        self.conn, self.version = conn, version
        self.started: dict[int, float] = {}
        self.ready: dict[int, float] = {}
        self._pending: deque[tuple[int, torch.cuda.Event | None]] = deque()
        self._delta: dict[int, list[tuple[int, int, int]]] = {}
        self._in_place: set[int] = set()

    def post(
        self,
        bucket: int,
        device: torch.device,
        started: float,
        delta: list[tuple[int, int, int]] | None = None,
        in_place: bool = False,
        queued: bool = False,
    ) -> None:
        """Bucket `bucket` is queued for packing on `device` (its stream's work so far);
        `delta`: (bucket, delta slot, bytes) of its payloads, encoded in staging too;
        `in_place`: packed straight into its destinations (posted once its event is done,
        as every bucket, so the bytes are visible before any immediate is delivered);
        `queued`: posted now, its packing only queued (the daemon's copies wait on the GPU
        for the pack counter, `BeginVersion.gate_offset`); its `ready` time is then when it
        was posted, not when it was packed."""
        self.started[bucket] = started
        if in_place:
            self._in_place.add(bucket)
        if delta:
            self._delta[bucket] = delta
        event = None
        if device.type == "cuda" and not queued:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
        self._pending.append((bucket, event))
        self._send(wait=False)

    def flush(self, bucket: int) -> None:
        """Post every packed bucket up to and including `bucket`, waiting for their events
        (before waiting for `bucket` to land: the daemon must have been told of it)."""
        while any(b == bucket for b, _ in self._pending):
            self._send(wait=True)

    def await_landed(
        self, landed: Landed, bucket: int, timeout_s: float, what: str, *, issued: bool = False
    ) -> bool:
        """Wait for a slot: until `bucket` (posted already) has landed, as `Landed.wait`
        (with `issued`: or its copies are issued, `Landed.events` tells).
        Meanwhile post each bucket queued before as soon as its packing completes: the
        daemon must not learn of bucket k only once the slot for k+N is free (that made the
        ring move one bucket at a time). The events are polled every `POLL_S`, the
        landing wakes this thread at once."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            self._send(wait=False)
            if not self._pending:
                break
            outcome = landed.poll(bucket, POLL_S, issued=issued)
            if outcome is not None:
                return outcome
            if time.monotonic() >= deadline:
                raise landed.timed_out(bucket, timeout_s, what)
        return landed.wait(bucket, max(deadline - time.monotonic(), 0.0), what, issued=issued)

    def await_posted(self, landed: Landed, bucket: int, timeout_s: float, what: str) -> bool:
        """Post every packed bucket up to and including `bucket`, as each one's packing
        completes (the GPU may wait for slot counters meanwhile: the daemon writes them as
        it learns of buckets). False, at once, if the version ended first (failed, or the
        daemon was lost: the counters may never be written, so no CUDA event is waited for
        without looking at that). The events are polled, without holding the GIL between
        polls; TimeoutError_ after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while any(b == bucket for b, _ in self._pending):
            self._send(wait=False)
            if not any(b == bucket for b, _ in self._pending):
                break
            if landed.ended:
                return False
            if time.monotonic() >= deadline:
                raise TimeoutError_(
                    f"{what}: bucket {bucket} was not packed within {timeout_s:.0f} s (its "
                    "ring slot's counter never reached it)"
                )
            time.sleep(0)  # let the connection's thread run
        return True

    def drain(self, landed: Landed, timeout_s: float, what: str) -> bool:
        """As `finish`, without blocking on an event the version's end would leave
        waiting forever (GPU slot counters): see `await_posted`."""
        if not self._pending:
            return True
        return self.await_posted(landed, self._pending[-1][0], timeout_s, what)

    def finish(self) -> None:
        """Every bucket is queued: post the rest as they complete."""
        while self._pending:
            self._send(wait=True)

    def abandon(self) -> None:
        """Packing failed: post nothing more (the caller aborts the version)."""
        self._pending.clear()

    def _send(self, *, wait: bool) -> None:
        """Post the packed buckets at the head of the queue; with `wait`, at least one."""
        ready: list[int] = []
        while self._pending:
            bucket, event = self._pending[0]
            if event is not None and not event.query():  # type: ignore[no-untyped-call]
                if ready or not wait:
                    break
                event.synchronize()  # releases the GIL while it waits
            self._pending.popleft()
            ready.append(bucket)
        if ready:
            now = time.time()
            for b in ready:
                self.ready[b] = now
            delta = tuple(d for b in ready for d in self._delta.pop(b, ()))
            in_place = tuple(b for b in ready if b in self._in_place)
            self.conn.send(
                BucketReady(
                    version=self.version,
                    bucket=ready[0],
                    more=tuple(ready[1:]),
                    delta=delta,
                    in_place=in_place,
                )
            )


@dataclass(frozen=True)
class PublishStats:
    version: int
    nbytes: int
    writes: int
    seconds: float  # from the daemon accepting the version until every write landed
    pack_seconds: float  # time spent packing buckets (overlaps the transfer)
    transfer_seconds: float  # from the first write posted until the last one landed
    total_seconds: float  # the whole publish call
    buckets: tuple[BucketTimes, ...] = ()
    delta_bytes: int = 0  # of nbytes, delta payloads and trailers
    density: float = 0.0  # changed elements / elements compared (delta buckets)
    replicas: tuple[ReplicaOutcome, ...] = ()  # elastic jobs: each engine replica's outcome
    slot_events: int = 0  # ring slots reused once the GPU waits on the copies' events
    slot_landings: int = 0  # ring slots reused once the copies landed (waited for on the CPU)
    slot_counters: int = 0  # ring slots waited for on the GPU, on counters the daemon writes
    begin_seconds: float = 0.0  # from the publish call until the daemon accepted the version
    begin_request_seconds: float = 0.0  # of it, the BeginVersion request's round trip alone
    compared: int = 0  # units compared with the shadow (each slot's width: 2 bytes, fp8 1)
    timeline: dict[str, float] = field(default_factory=dict)  # PublishResult.timeline
    gated: bool = False  # buckets posted once queued: the copies waited for the pack counter


@dataclass(frozen=True)
class BucketTimes:
    """Wall-clock times of one bucket: packing started, packed (its CUDA event done),
    posted by the daemon, and every write of it landed."""

    index: int
    nbytes: int
    prepare_start: float
    prepared: float
    posted: float
    landed: float


def bucket_times(plan: RankPlan, poster: Poster, result: PublishResult) -> tuple[BucketTimes, ...]:
    """Each bucket's times: packing on this rank (`poster`), posting and landing (`result`)."""
    return tuple(
        BucketTimes(
            index=b.index,
            nbytes=b.nbytes,
            prepare_start=poster.started.get(b.index, 0.0),
            prepared=poster.ready.get(b.index, 0.0),
            posted=result.buckets[b.index][0] if b.index < len(result.buckets) else 0.0,
            landed=result.buckets[b.index][1] if b.index < len(result.buckets) else 0.0,
        )
        for b in plan.buckets
    )
