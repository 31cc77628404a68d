"""A device's copy lane: its stream, and the thread that waits for its copies.

Copies are issued on the event loop: `cuMemcpy*Async` only queues work on the stream, so
the loop thread issues a whole batch without handing the GIL back and forth. (Issued
from a worker thread, every driver call re-takes the GIL from a busy loop, which spaced a
trainer's copies up to a switch interval apart and left the copy engines idle.) One event
follows each batch; the lane's completion thread blocks on the events, in order, off the
loop, and hands each finished batch back to it. A bounded number of batches is in flight
per lane, so the stream's queue never fills and issuing never blocks the loop. (A copy
from pageable host memory can wait for itself: such a batch is issued on a thread.)
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from weightwire.transport.cudadrv import MAX_PITCH, CudaError, Driver

MAX_BATCHES_IN_FLIGHT = 64


@dataclass(eq=False, slots=True)
class Copy:
    """One write, as the copying device sees it."""

    index: int  # in its batch
    dst: int
    src: int
    nbytes: int
    imm: int | None
    dst_node: str
    dst_device: int = -1  # set when the copy crosses GPUs through cuMemcpyPeerAsync
    count: int = 1  # blocks of `nbytes` (a strided write), one 2-D copy
    src_stride: int = 0
    dst_stride: int = 0


@dataclass(eq=False, slots=True)
class Batch:
    """Copies issued together on one stream, completed by one event."""

    copies: list[Copy]
    future: asyncio.Future[dict[int, BaseException]]  # failures by index; {} when all landed
    event: int = 0
    failures: dict[int, BaseException] = field(default_factory=dict)

    def landed(self) -> list[Copy]:
        return [c for c in self.copies if c.index not in self.failures]


class Lane:
    """Issues batches on one device's stream and completes them in order."""

    def __init__(
        self,
        drv: Driver,
        device: int,
        loop: asyncio.AbstractEventLoop,
        on_landed: Callable[[Batch], None],
        max_in_flight: int = MAX_BATCHES_IN_FLIGHT,
    ) -> None:
        self._drv = drv
        self.device = device
        self._loop = loop
        self._on_landed = on_landed
        self._room = asyncio.Semaphore(max_in_flight)
        self._issuing = asyncio.Lock()
        drv.use(device)
        self._stream = drv.stream()
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._complete, name=f"ww-cuda-{device}", daemon=True
        )
        self._thread.start()

    async def submit(
        self, copies: list[Copy], *, blocking: bool = False
    ) -> dict[int, BaseException]:
        """Issue `copies`; resolves with the failures by index once they have all landed.
        `blocking`: issuing may wait for the copy itself (a source in pageable host
        memory), so it is done on a thread rather than on the loop."""
        await self._room.acquire()
        batch = Batch(copies, self._loop.create_future())
        try:
            async with self._issuing:  # events reach the queue in the stream's order
                if blocking:
                    await asyncio.to_thread(self._issue, batch)
                else:
                    self._issue(batch)
                if batch.event:
                    self._queue.put(batch)
        except BaseException:
            self._room.release()
            raise
        if not batch.event:
            self._finish(batch)
        return await batch.future

    def _issue(self, batch: Batch) -> None:
        try:
            self._drv.use(self.device)
            for c in batch.copies:
                try:
                    _issue(self._drv, c, self.device, self._stream)
                except CudaError as exc:
                    batch.failures[c.index] = exc
            batch.event = self._drv.event()
            self._drv.record(batch.event, self._stream)
        except CudaError as exc:
            batch.failures = {c.index: exc for c in batch.copies}
            if batch.event:
                with contextlib.suppress(CudaError):
                    self._drv.destroy_event(batch.event)
                batch.event = 0

    def _complete(self) -> None:
        """The lane's thread: wait for each batch's event, in issue order."""
        self._drv.use(self.device)
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self._drv.wait_event(batch.event)
            except CudaError as exc:
                batch.failures = {c.index: exc for c in batch.copies}
            finally:
                with contextlib.suppress(CudaError):
                    self._drv.destroy_event(batch.event)
            self._loop.call_soon_threadsafe(self._finish, batch)

    def _finish(self, batch: Batch) -> None:
        self._room.release()
        self._on_landed(batch)
        if not batch.future.done():
            batch.future.set_result(batch.failures)

    def stop(self) -> None:
        """Ends the thread after the batches already queued (join it off the loop)."""
        self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _issue(drv: Driver, c: Copy, device: int, stream: int) -> None:
    """Queue one write's copies on `stream`: a strided write as one 2-D copy."""
    if c.count > 1 and c.dst_device < 0 and max(c.src_stride, c.dst_stride) <= MAX_PITCH:
        drv.copy_2d_async(c.dst, c.dst_stride, c.src, c.src_stride, c.nbytes, c.count, stream)
        return
    for i in range(c.count):
        dst, src = c.dst + i * c.dst_stride, c.src + i * c.src_stride
        if c.dst_device >= 0:
            drv.copy_peer_async(dst, c.dst_device, src, device, c.nbytes, stream)
        else:
            drv.copy_async(dst, src, c.nbytes, stream)
