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

_EMPTY = object()


def _packed(event: torch.cuda.Event | None) -> bool:
    return event is None or bool(event.query())


class Poster:
    """Tells the daemon a bucket is packed once its CUDA event has completed, on a thread of
    its own, so that the GPU packs bucket k+1 while the daemon moves bucket k. Buckets that
    finished packing meanwhile go in the same message (a fast pack posts in few messages)."""

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
        item = self._queue.get()
        while item is not None:
            bucket, event = item
            if event is not None:
                event.synchronize()
            ready = [bucket]
            item = self._take_nowait()
            while item is not None and item is not _EMPTY and _packed(item[1]):
                ready.append(item[0])  # packed meanwhile: posted in the same message
                item = self._take_nowait()
            now = time.time()
            for b in ready:
                self.ready[b] = now
            more = tuple(ready[1:])
            self.conn.send(BucketReady(version=self.version, bucket=ready[0], more=more))
            if item is _EMPTY:
                item = self._queue.get()

    def _take_nowait(self) -> tuple[int, torch.cuda.Event | None] | object | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return _EMPTY

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
