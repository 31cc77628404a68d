"""A copy lane: one stream from a device to one destination device, and the thread that
waits for its copies. A lane per destination lets a GPU's copies to two peers run side by
side: on one stream, the copies to a busy peer would hold back those to an idle one.

Copies are issued on the event loop: `cuMemcpy*Async` only queues work on the stream, so
the loop thread issues a whole chunk without handing the GIL back and forth. (Issued
from a worker thread, every driver call re-takes the GIL from a busy loop, which spaced a
trainer's copies up to a switch interval apart and left the copy engines idle.) One event
follows each chunk; the lane's completion thread blocks on the events, in order, off the
loop, and hands each finished batch back to it.

Posting is synchronous: a post's chunks join the lane's queue and are issued at once, in
order, as far as the lane's budget of driver operations in flight allows (with the
stream's queue full, the next copy call would wait); the rest are issued as batches land.
A chunk that alone needs more than the budget, or whose source is pageable host memory
(the driver may wait for such a copy), is issued on a thread, and nothing after it is
issued before it. A writer cancelled before its chunks were issued takes them off the
queue; chunks already issued finish on their own. A closing lane refuses new posts,
fails those still queued, and completes those already issued. Copies into regions of
this process are counted from issue to landing (`inflight.py`): one whose region was
deregistered since it was resolved is refused, one issued before fails once it lands.

A post may be gated (a trainer rank's pack counter, `daemon/packgate.py`): the stream
waits on the GPU for a 32-bit word to reach a value before the post's first copy, so the
copies are queued before the rank's packing of what they read is done. The lane's stream
runs posts in the order they were made, which the publisher keeps in bucket order.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from weightwire.memory.cudadrv import CudaError, Driver
from weightwire.protocol.errors import PeerLostError
from weightwire.transport.base import POST_STAMPS

from .budget import OpBudget
from .copies import Chunk, issue
from .inflight import REGIONS, Key

# About 1000 copy calls queue on an H200 stream before the next one waits (measured).
MAX_OPS_IN_FLIGHT = 512

Failures = dict[int, BaseException]
"""The writes of a post that failed, by their index in it; {} when every one landed."""


@dataclass(eq=False, slots=True)
class Fence:
    """An interprocess event the lane records on its stream right after issuing a post's
    last chunk; `on_issued` is then called on the loop (not if recording failed)."""

    event: int
    on_issued: Callable[[], None]
    recorded: bool = False


@dataclass(eq=False, slots=True)
class Post:
    """One writer's chunks on a lane; its future resolves once every one has finished."""

    future: asyncio.Future[Failures]
    pending: int
    failures: Failures = field(default_factory=dict)
    fence: Fence | None = None
    stamps: dict[str, float] | None = None  # POST_STAMPS of its caller: first issued/seen/finished

    def stamp(self, key: str) -> None:
        """The first time (monotonic) `key` happened to a chunk of this post, if asked."""
        if self.stamps is not None and key not in self.stamps:
            self.stamps[key] = time.monotonic()

    gate: tuple[int, int] | None = None  # (address, value): the stream waits for it first
    gate_failed: BaseException | None = None  # the wait could not be queued: nothing copies

    def settle(self, failures: Failures) -> None:
        if failures:
            self.failures.update(failures)
        self.pending -= 1
        if self.pending == 0 and not self.future.done():
            self.future.set_result(self.failures)


@dataclass(eq=False, slots=True)
class Batch:
    """A chunk as posted once: with that post's immediates, issued and completed together."""

    chunk: Chunk
    imms: Sequence[int | None]  # one per copy
    post: Post
    blocking: bool
    last: bool = False  # the post's last chunk: its fence is recorded after it
    first: bool = False  # the post's first chunk: its gate is waited for before it
    taken: int = 0  # of the lane's budget
    event: int = 0
    failures: Failures = field(default_factory=dict)
    entered: list[Key] = field(default_factory=list)  # regions it counts as written into


class Lane:
    """Issues chunks on its stream (from `device`) and completes them in order."""

    def __init__(
        self,
        drv: Driver,
        device: int,
        loop: asyncio.AbstractEventLoop,
        on_landed: Callable[[Batch], None],
        max_ops: int = MAX_OPS_IN_FLIGHT,
        name: str = "",
    ) -> None:
        self._drv = drv
        self.device = device
        self._loop = loop
        self._on_landed = on_landed
        self.budget = OpBudget(max_ops)
        self._waiting: deque[Batch] = deque()
        self._on_thread: asyncio.Task[None] | None = None  # a batch being issued on a thread
        self._closed = False
        self._inflight: set[Batch] = set()  # taken from _waiting, not finished yet
        self._drains: list[tuple[set[Batch], asyncio.Future[None]]] = []
        self.issued = {"loop": 0, "thread": 0}
        drv.use(device)
        self._stream = drv.stream()
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._complete, name=name or f"ww-cuda-{device}", daemon=True
        )
        self._thread.start()

    def post(
        self,
        posted: Sequence[tuple[Chunk, Sequence[int | None]]],
        *,
        blocking: bool = False,
        fence: Fence | None = None,
        gate: tuple[int, int] | None = None,
    ) -> asyncio.Future[Failures]:
        """Queue chunks with their immediates and issue what the budget allows now; the
        future resolves with the failures once every chunk has landed or failed.
        `blocking`: issuing may wait for the copy itself (pageable host memory).
        `fence`: recorded once the last chunk is issued (whenever the budget lets it be).
        `gate`: (address, value): the stream waits on the GPU until the 32-bit word at
        `address` reaches `value` (cuStreamWaitValue32, GEQ) before the first copy. Posts
        are issued in the order they are made, so a caller whose gates depend on one
        another's copies (a rank's ring) posts them in that order."""
        post = Post(
            self._loop.create_future(),
            len(posted),
            fence=fence,
            gate=gate,
            stamps=POST_STAMPS.get(),
        )
        if self._closed:
            err = PeerLostError("the cuda transport is closing")
            post.future.set_result({c.index: err for ch, _ in posted for c in ch.copies})
            return post.future
        if not posted:
            post.future.set_result({})
            return post.future
        for i, (chunk, imms) in enumerate(posted):
            batch = Batch(chunk, imms, post, blocking, last=i == len(posted) - 1, first=i == 0)
            self._waiting.append(batch)
        self._pump()
        return post.future

    def _pump(self) -> None:
        """Issue queued batches, in order, while the budget has room."""
        while self._waiting and self._on_thread is None and not self._closed:
            batch = self._waiting[0]
            if batch.post.future.done():  # its writer was cancelled: never issued
                self._waiting.popleft()
                continue
            batch.taken = self.budget.try_take(batch.chunk.ops)
            if not batch.taken:
                return
            self._waiting.popleft()
            self._inflight.add(batch)
            if batch.blocking or batch.chunk.ops > self.budget.limit:
                self.issued["thread"] += 1
                self._on_thread = self._loop.create_task(self._issue_on_thread(batch))
                return
            self.issued["loop"] += 1
            self._issue(batch)
            self._queued(batch)

    async def _issue_on_thread(self, batch: Batch) -> None:
        try:
            await asyncio.to_thread(self._issue, batch)
        except BaseException:  # the loop is going away: no copy of it is reported landed
            err = PeerLostError("the cuda lane stopped while issuing")
            batch.failures = {c.index: err for c in batch.chunk.copies}
            raise
        finally:
            self._on_thread = None
            self._queued(batch)
            self._pump()

    def _queued(self, batch: Batch) -> None:
        fence = batch.post.fence
        if batch.last and fence is not None and fence.recorded:
            fence.on_issued()
        if batch.event:
            self._queue.put(batch)
        else:  # no event: every copy failed to issue. Finished from the loop, not from
            self._loop.call_soon(self._finish, batch)  # inside _pump (no recursion)

    def _issue(self, batch: Batch) -> None:
        try:
            self._drv.use(self.device)
            post = batch.post
            if batch.first and post.gate is not None:
                try:
                    self._drv.wait_value32(self._stream, *post.gate)
                except CudaError as exc:  # not waited for: none of the post may be copied
                    post.gate_failed = exc
            if post.gate_failed is not None:
                batch.failures = {c.index: post.gate_failed for c in batch.chunk.copies}
            else:  # copies into a region deregistered since they were resolved: refused
                batch.entered, batch.failures = REGIONS.enter(batch.chunk)
            for c in batch.chunk.copies if post.gate_failed is None else ():
                if c.index in batch.failures:
                    continue
                try:
                    issue(self._drv, c, self.device, self._stream)
                except CudaError as exc:
                    batch.failures[c.index] = exc
            batch.event = self._drv.event()
            self._drv.record(batch.event, self._stream)
            batch.post.stamp("issued")
            fence = batch.post.fence
            if batch.last and fence is not None:
                with contextlib.suppress(CudaError):  # not recorded: the landing frees the slot
                    self._drv.record(fence.event, self._stream)
                    fence.recorded = True
        except Exception as exc:  # a broken context, or a bug: none of it is reported landed
            batch.failures = {c.index: exc for c in batch.chunk.copies}
            if batch.entered:  # no event to wait for: what was issued, before its regions go
                with contextlib.suppress(CudaError):
                    self._drv.synchronize(self._stream)
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
                batch.post.stamp("seen")
            except CudaError as exc:
                batch.failures = {c.index: exc for c in batch.chunk.copies}
            finally:
                with contextlib.suppress(CudaError):
                    self._drv.destroy_event(batch.event)
                REGIONS.leave(batch.entered)  # its copies are done: the regions may go
                batch.entered = []
            try:
                self._loop.call_soon_threadsafe(self._finish, batch)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                return

    def _finish(self, batch: Batch) -> None:
        batch.post.stamp("finished")
        self.budget.give(batch.taken)
        self._inflight.discard(batch)
        for left, fut in self._drains:
            left.discard(batch)
            if not left and not fut.done():
                fut.set_result(None)
        self._drains = [(left, fut) for left, fut in self._drains if left]
        REGIONS.leave(batch.entered)  # never waited for (not issued): nothing copies
        batch.entered = []
        REGIONS.withdrawn(batch.chunk, batch.failures)  # its region went meanwhile
        try:
            self._on_landed(batch)
        finally:
            batch.post.settle(batch.failures)
            self._pump()

    async def fence(self, to_node: str, err: BaseException) -> None:
        """Fail the queued batches with a copy into `to_node`'s memory, and return once
        every batch already issued has finished: none of them copies anything after."""
        keep: deque[Batch] = deque()
        while self._waiting:
            batch = self._waiting.popleft()
            if any(c.dst_node == to_node for c in batch.chunk.copies):
                batch.post.settle({c.index: err for c in batch.chunk.copies})
            else:
                keep.append(batch)
        self._waiting = keep
        if self._inflight:
            fut: asyncio.Future[None] = self._loop.create_future()
            self._drains.append((set(self._inflight), fut))
            await fut

    async def stop(self) -> None:
        """Refuses new posts and fails those queued; the thread ends after the batches
        already issued."""
        self._closed = True
        err = PeerLostError("the cuda transport is closing")
        while self._waiting:
            batch = self._waiting.popleft()
            batch.post.settle({c.index: err for c in batch.chunk.copies})
        if self._on_thread is not None:
            await asyncio.wait([self._on_thread])
        self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
