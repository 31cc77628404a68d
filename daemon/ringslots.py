"""A rank that packs into a ring of staging slots, told when a slot is free again: by
`BucketsLanded` once the bucket's writes landed; by `BucketsIssued` once its copies are
all issued on transports that fence the slot on the GPU (cuda), with their events; or, where
the rank waits on GPU slot counters (slotfence.py), by the counter written on the GPU behind
those events, or at landing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from weightwire.memory.cudadrv import CudaError
from weightwire.protocol.errors import TransferError, WeightwireError
from weightwire.protocol.local import BucketsIssued, BucketsLanded, PublishResult
from weightwire.transport.base import CudaEvents, SlotFencing

from .prepared import Part
from .runs import Run

log = structlog.get_logger("weightwire.daemon.publisher")

Reply = Callable[[PublishResult | BucketsLanded | BucketsIssued], None]
"""To the rank's session."""
Issued = Callable[[tuple[bytes, ...]], None]


class FailRun(Protocol):
    """`run`'s version fails with `err` (the rank is told, the destinations too)."""

    def __call__(self, err: WeightwireError, run: Run) -> None: ...


@dataclass(frozen=True)
class RingSlots:
    """One trainer rank's ring slot reports."""

    job: str
    rank: int
    reply: Reply
    fail: FailRun

    def slot_key(self, run: Run, bucket: int) -> tuple[str, int, int]:
        return (self.job, self.rank, run.ring.slot[bucket])

    def fencing(self, run: Run, bucket: int, parts: list[Part]) -> list[Issued | None]:
        """Per part, what its transport calls once the part's copies are all issued, where
        the rank waits for slots on the GPU and every part is on a transport that fences
        (cuda); the last one tells the rank `BucketsIssued` with every part's events.
        Otherwise None each: the rank waits for the landing."""
        if not (run.slot_events or run.counters) or not parts:
            return [None] * len(parts)
        if not all(isinstance(p.transport, SlotFencing) for p in parts):
            return [None] * len(parts)
        events: list[bytes] = []
        left = [len(parts)]

        def issued(handles: tuple[bytes, ...]) -> None:
            events.extend(handles)
            left[0] -= 1
            if not left[0] and not run.finished and run.counters is not None:
                self._signal_issued(run, bucket, parts, tuple(dict.fromkeys(events)))
            elif not left[0] and not run.finished:
                run.issued += 1
                self.reply(
                    BucketsIssued(
                        version=run.version,
                        buckets=(bucket,),
                        events=tuple(dict.fromkeys(events)),
                    )
                )
            if not left[0]:  # its slot's events are waited for already: they may be reused
                self.handed(run, bucket)

        return [issued] * len(parts)

    def _signal_issued(
        self, run: Run, bucket: int, parts: list[Part], handles: tuple[bytes, ...]
    ) -> None:
        """Every cuda copy of `bucket` is queued: its slot counter is written on the GPU
        once the copies' events are (left to the landing if the events are not known)."""
        assert run.counters is not None
        transport = parts[0].transport
        events = transport.events_of(handles) if isinstance(transport, CudaEvents) else None
        if events is None:
            return
        try:
            run.counters.signal(bucket, events)
        except CudaError as exc:  # the landing writes it
            log.warning("slot counter not written on the GPU", bucket=bucket, error=exc.message)
            return
        run.on_gpu.add(bucket)
        run.issued += 1

    def handed(self, run: Run, bucket: int) -> None:
        """`bucket` has handed over its slot's fences (or has none, or its post ended):
        the next gated bucket of its slot may be posted (`Poster._handed`)."""
        done = run.handed.get(bucket)
        if done is not None and not done.done():
            done.set_result(None)

    def slot_free(self, run: Run, bucket: int) -> None:
        """Every write of `bucket` landed: its ring slot is free. The rank learns it from
        `BucketsLanded`, or from its slot counter where it waits on the GPU (written here
        unless its copies' events wrote it already)."""
        if not run.ring.slots or run.finished:
            return
        if run.counters is None:
            self.reply(BucketsLanded(version=run.version, buckets=(bucket,)))
            return
        if bucket in run.on_gpu:
            return  # written on the GPU behind its copies already
        try:
            run.counters.signal(bucket)
        except CudaError as exc:
            self.fail(TransferError(f"slot counter of bucket {bucket}: {exc.message}"), run)


def release(run: Run) -> None:
    """A failed version: the copies waiting for the rank's packing go ahead (its pack
    counter), and the rank's GPU waits on its slot counters all end."""
    if run.gate is not None:
        try:
            run.gate.release()
        except CudaError as exc:
            log.error("pack counter not released", version=run.version, error=exc.message)
    if run.counters is None:
        return
    try:
        run.counters.release()
    except CudaError as exc:  # the rank releases them itself when it learns the outcome
        log.error("slot counters not released", version=run.version, error=exc.message)
