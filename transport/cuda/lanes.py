"""A copy lane: one stream from a device to one destination device, and the thread that
waits for its copies. A lane per destination lets a GPU's copies to two peers run side by
side: on one stream, the copies to a busy peer would hold back those to an idle one.

Copies are issued on the event loop: `cuMemcpy*Async` only queues work on the stream, so
the loop thread issues a whole batch without handing the GIL back and forth. (Issued
from a worker thread, every driver call re-takes the GIL from a busy loop, which spaced a
trainer's copies up to a switch interval apart and left the copy engines idle.) One event
follows each batch; the lane's completion thread blocks on the events, in order, off the
loop, and hands each finished batch back to it.

A lane bounds the driver operations in flight (copies, and rows of strided writes the
driver cannot take as one 2-D copy): with the stream's queue full, the next copy call
would wait. A batch that alone needs more than the bound, or whose source is pageable host
memory (the driver may wait for such a copy), is issued on a thread. A writer cancelled
mid-write leaves its batch to finish on its own; a closing lane refuses new batches and
completes those already issued.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from weightwire.protocol.errors import PeerLostError
from weightwire.transport.cudadrv import MAX_PITCH, CudaError, Driver

from .budget import OpBudget

# About 1000 copy calls queue on an H200 stream before the next one waits (measured).
MAX_OPS_IN_FLIGHT = 512
# One batch (one event) holds at most this much, so that landings are reported, and the
# budget comes back, while a large post is still copying.
BATCH_OPS = 64
BATCH_BYTES = 1 << 30


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

    @property
    def as_2d(self) -> bool:
        return (
            self.count > 1
            and self.dst_device < 0
            and max(self.src_stride, self.dst_stride) <= MAX_PITCH
        )

    @property
    def ops(self) -> int:
        """Driver calls that issue it."""
        return 1 if self.as_2d or self.count == 1 else self.count


@dataclass(eq=False, slots=True)
class Batch:
    """Copies issued together on one stream, completed by one event."""

    copies: list[Copy]
    future: asyncio.Future[dict[int, BaseException]]  # failures by index; {} when all landed
    taken: int = 0  # of the lane's budget
    event: int = 0
    failures: dict[int, BaseException] = field(default_factory=dict)

    def landed(self) -> list[Copy]:
        return [c for c in self.copies if c.index not in self.failures]


def batches(copies: list[Copy]) -> list[list[Copy]]:
    """`copies` in order, cut into batches of at most BATCH_OPS operations and BATCH_BYTES
    (a single larger copy is a batch of its own)."""
    out: list[list[Copy]] = []
    ops = nbytes = 0
    for c in copies:
        size = c.nbytes * c.count
        if out and ops + c.ops <= BATCH_OPS and nbytes + size <= BATCH_BYTES:
            out[-1].append(c)
            ops, nbytes = ops + c.ops, nbytes + size
        else:
            out.append([c])
            ops, nbytes = c.ops, size
    return out


class Lane:
    """Issues batches on its stream (from `device`) and completes them in order."""

    def __init__(
        self,
        drv: Driver,
        device: int,
        loop: asyncio.AbstractEventLoop,
        on_landed: Callable[[Batch], None],
        max_ops: int = MAX_OPS_IN_FLIGHT,
    ) -> None:
        self._drv = drv
        self.device = device
        self._loop = loop
        self._on_landed = on_landed
        self.budget = OpBudget(max_ops)
        self._issuing = asyncio.Lock()
        self._closed = False
        self.issued = {"loop": 0, "thread": 0}
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
        `blocking`: issuing may wait for the copy itself (pageable host memory)."""
        ops = sum(c.ops for c in copies) + 1  # and the event
        blocking = blocking or ops > self.budget.limit
        batch = Batch(copies, self._loop.create_future())
        batch.taken = await self.budget.take(ops)
        task = self._loop.create_task(self._issue_and_queue(batch, blocking))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)
        return await batch.future

    async def _issue_and_queue(self, batch: Batch, blocking: bool) -> None:
        try:
            async with self._issuing:  # events reach the queue in the stream's order
                if self._closed:
                    raise PeerLostError("the cuda transport is closing")
                if blocking:
                    self.issued["thread"] += 1
                    await asyncio.to_thread(self._issue, batch)
                else:
                    self.issued["loop"] += 1
                    self._issue(batch)
                if batch.event:
                    self._queue.put(batch)
                    return
        except BaseException:
            self.budget.give(batch.taken)
            raise
        self._finish(batch)  # no event: every copy failed to issue

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
            try:
                self._loop.call_soon_threadsafe(self._finish, batch)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                return

    def _finish(self, batch: Batch) -> None:
        self.budget.give(batch.taken)
        try:
            self._on_landed(batch)
        finally:
            if not batch.future.done():
                batch.future.set_result(batch.failures)

    async def stop(self) -> None:
        """Refuses new batches; the thread ends after those already issued."""
        self._closed = True
        async with self._issuing:
            self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _retrieve(task: asyncio.Task[None]) -> None:
    """A writer that was cancelled no longer awaits its batch's issue: take its outcome."""
    if not task.cancelled():
        task.exception()


def _issue(drv: Driver, c: Copy, device: int, stream: int) -> None:
    """Queue one write's copies on `stream`: a strided write as one 2-D copy."""
    if c.as_2d:
        drv.copy_2d_async(c.dst, c.dst_stride, c.src, c.src_stride, c.nbytes, c.count, stream)
        return
    for i in range(c.count):
        dst, src = c.dst + i * c.dst_stride, c.src + i * c.src_stride
        if c.dst_device >= 0:
            drv.copy_peer_async(dst, c.dst_device, src, device, c.nbytes, stream)
        else:
            drv.copy_async(dst, src, c.nbytes, stream)
