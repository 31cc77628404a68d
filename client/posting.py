"""What a publish leaves behind it on the trainer side: the thread that tells the daemon
each bucket is packed, and the times it reports."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from weightwire.protocol.local import BucketReady

from .connection import DaemonConnection


class Poster:
    """Tells the daemon a bucket is packed once its CUDA event has completed, on a thread of
    its own, so that the GPU packs bucket k+1 while the daemon moves bucket k."""

    def __init__(self, conn: DaemonConnection, version: int) -> None:
        self.conn, self.version = conn, version
        self.started: dict[int, float] = {}
        self.ready: dict[int, float] = {}
        self._queue: queue.SimpleQueue[tuple[int, torch.cuda.Event | None] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._done = False

    def post(self, bucket: int, device: torch.device, started: float) -> None:
        self.started[bucket] = started
        if device.type != "cuda":
            self.ready[bucket] = time.time()
            self.conn.send(BucketReady(version=self.version, bucket=bucket))
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ww-poster", daemon=True)
            self._thread.start()
        self._queue.put((bucket, event))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            bucket, event = item
            if event is not None:
                event.synchronize()
            self.ready[bucket] = time.time()
            self.conn.send(BucketReady(version=self.version, bucket=bucket))

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()


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
