"""A rank's connection to its daemon: synchronous calls over a background event loop.

The ZeroMQ socket lives on a private loop thread, so requests from the caller's
thread and notifications from the daemon (version complete, publish result) never
share a socket across threads. Notifications are handed to callbacks on a thread
of their own, so a slow callback never stalls the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from weightwire.memory.hostmem import SHM_DIR, SharedFile, create_shared
from weightwire.protocol.errors import (
    ErrorCode,
    NoDaemonError,
    ProtocolError,
    TimeoutError_,
    WeightwireError,
    error_from_code,
)
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import (
    SOCKET_ENV,
    SOCKET_PATH,
    Error,
    Goodbye,
    Hello,
    LocalMessage,
    LocalMsg,
    Ping,
    Welcome,
)

DEFAULT_SOCKET = os.environ.get(SOCKET_ENV, SOCKET_PATH)

Notification = Callable[[LocalMessage], None]
REGION_ALIGN = 256  # where each tensor starts in a rank's region file


def aligned(sizes: Iterable[int], align: int = REGION_ALIGN) -> tuple[list[int], int]:
    """Where blocks of `sizes` bytes start laid one after another, each at a multiple of
    `align`; and where the last ends."""
    offsets, end = [], 0
    for n in sizes:
        end = -(-end // align) * align
        offsets.append(end)
        end += n
    return offsets, end


_RESET = Goodbye()  # marks "the daemon forgot this session" in the notification queue
_LOST = Ping()  # marks "the daemon stopped answering"


class DaemonConnection:
    def __init__(
        self,
        path: str | None = None,
        *,
        on_notify: Notification | None = None,
        on_reset: Callable[[], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        ping_interval_s: float = 1.0,
        lost_after_s: float = 5.0,
    ) -> None:
        self.path = path or DEFAULT_SOCKET
        if not os.path.exists(self.path):
            raise NoDaemonError(
                f"no daemon socket at {self.path} (is weightwired running? "
                f"set WEIGHTWIRE_SOCKET or pass socket=)"
            )
        self._codec: Codec[LocalMessage] = Codec(LocalMessage, max_bytes=1 << 30)
        self._reqs = itertools.count(1)
        self._pending: dict[int, asyncio.Future[LocalMessage]] = {}
        self._read_at: dict[int, float] = {}
        # perf_counter points of the last request of each kind: called, sent, reply read, woke
        self.last_traces: dict[type, tuple[float, float, float, float]] = {}
        self._on_notify = on_notify
        self._on_reset = on_reset  # the daemon restarted and forgot us: register again
        self._on_lost = on_lost  # the daemon has not answered for `lost_after_s`
        self._ping_interval_s = ping_interval_s
        self.lost_after_s = lost_after_s
        self.last_answer = time.monotonic()
        self.lost = False
        self.session: str | None = None
        self._epoch = 0  # counts sessions established (each Welcome)
        self.region_dir = SHM_DIR  # where the daemon maps rank region files from (Welcome)
        self.fd_socket = ""  # where the daemon takes file descriptors (Welcome; "": nowhere)
        self.max_message_bytes = 0  # the daemon's limit on a request (Welcome; 0: unknown)
        self._reset_lock = threading.Lock()
        self._notes: queue.SimpleQueue[LocalMessage | None] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ww-conn", daemon=True)
        self._thread.start()
        self._notifier = threading.Thread(target=self._deliver, name="ww-notify", daemon=True)
        self._notifier.start()
        self._sock: zmq.asyncio.Socket | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._closed = False
        self._run(self._open()).result(10)

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.path}")
        self._sock = sock
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._pinger = asyncio.get_running_loop().create_task(self._ping())

    async def _ping(self) -> None:
        """Keep the session alive; notice a daemon that stopped answering or restarted."""
        while True:
            await asyncio.sleep(self._ping_interval_s)
            if self.session is None:
                continue
            try:
                reply = await self._request(Ping(), self._ping_interval_s * 3)
            except TimeoutError_:
                silent = time.monotonic() - self.last_answer
                if silent > self.lost_after_s and not self.lost:
                    self.lost = True
                    self._notes.put(_LOST)
                continue
            self.last_answer = time.monotonic()
            self.lost = False
            if isinstance(reply, Error) and reply.code == ErrorCode.NO_SESSION.value:
                self._notes.put(_RESET)

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg, _ = self._codec.decode(frames)
            except ProtocolError:
                continue
            fut = self._pending.pop(msg.req, None) if msg.req else None
            if fut is not None:
                self._read_at[msg.req] = time.perf_counter()
                if not fut.done():
                    fut.set_result(msg)
            else:
                self._notes.put(msg)

    def _deliver(self) -> None:
        while True:
            msg = self._notes.get()
            if msg is None:
                return
            if msg is _RESET or msg is _LOST:
                try:
                    if msg is _RESET:
                        self.reset(self._epoch)
                    elif self._on_lost is not None:
                        self._on_lost()
                except Exception as exc:  # keep delivering; the owner sees the next call fail
                    print(f"weightwire: recovering the session failed: {exc!r}", file=sys.stderr)
                continue
            if self._on_notify is not None:
                self._on_notify(msg)

    async def _request(
        self, msg: LocalMsg, timeout_s: float, trace: list[float] | None = None
    ) -> LocalMessage:
        assert self._sock is not None
        req = next(self._reqs)
        fut: asyncio.Future[LocalMessage] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        try:
            await self._sock.send_multipart(self._encode(msgspec.structs.replace(msg, req=req)))
            if trace is not None:
                trace.append(time.perf_counter())
                trace.append(req)
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TimeoutError_(
                f"the daemon at {self.path} did not answer {type(msg).__name__} within "
                f"{timeout_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(req, None)

    def request(self, msg: LocalMsg, timeout_s: float = 30.0) -> LocalMessage:
        """Send a request and return its reply; an `Error` reply is raised as its exception.

        If the daemon no longer knows this session (it restarted), the owner's `on_reset`
        registers everything again and the request is sent once more.
        """
        if self._closed:
            raise WeightwireError("the connection is closed", code=ErrorCode.PEER_LOST)
        epoch = self._epoch
        trace = [time.perf_counter()]
        reply: LocalMessage = self._run(self._request(msg, timeout_s, trace)).result(timeout_s + 5)
        if len(trace) == 3:
            read = self._read_at.pop(int(trace[2]), trace[1])
            self.last_traces[type(msg)] = (trace[0], trace[1], read, time.perf_counter())
        forgotten = isinstance(reply, Error) and reply.code == ErrorCode.NO_SESSION.value
        if forgotten and self._on_reset is not None and not isinstance(msg, Hello):
            self.reset(epoch)
            reply = self._run(self._request(msg, timeout_s)).result(timeout_s + 5)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if isinstance(reply, Welcome):
            self.session = reply.session
            self.region_dir = reply.region_dir or SHM_DIR
            self.fd_socket = reply.fd_socket
            self.max_message_bytes = reply.max_message_bytes
            self._epoch += 1
        return reply

    def reset(self, seen_epoch: int) -> None:
        """Register again, once per lost session however many callers noticed it."""
        with self._reset_lock:
            if self._epoch != seen_epoch or self._on_reset is None:
                return
            self.session = None
            self._on_reset()

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every request still waiting for a reply (the daemon is gone or restarted)."""

        def fail() -> None:
            for fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(exc)

        self._loop.call_soon_threadsafe(fail)

    @property
    def socket_gid(self) -> int:
        return os.stat(self.path).st_gid

    @contextlib.contextmanager
    def region_file(self, nbytes: int, purpose: str) -> Iterator[SharedFile]:
        """A new shared file of `nbytes` (at least 1) for a region of this rank's, where the
        daemon maps them from; removed again if the block (registering it) raises."""
        shared = create_shared(
            max(nbytes, 1), purpose=purpose, gid=self.socket_gid, directory=self.region_dir
        )
        try:
            yield shared
        except BaseException:
            shared.unlink()
            shared.close()
            raise

    def send(self, msg: LocalMsg) -> None:
        """Send without waiting for a reply (messages keep their order)."""
        assert self._sock is not None
        frames = self._encode(msg)
        self._loop.call_soon_threadsafe(self._send_now, frames)

    def _encode(self, msg: LocalMsg) -> list[Any]:
        """The message's frames; one larger than the daemon takes is refused here, with the
        error the daemon would give, instead of being sent."""
        frames = self._codec.encode(msg)
        size = sum(memoryview(f).nbytes for f in frames)
        if self.max_message_bytes and size > self.max_message_bytes:
            raise ProtocolError(
                f"{type(msg).__name__} of {size} bytes exceeds the daemon's limit of "
                f"{self.max_message_bytes} bytes (max_message_bytes)",
                code=ErrorCode.TOO_LARGE,
            )
        return frames

    def _send_now(self, frames: list[Any]) -> None:
        assert self._sock is not None
        self._sock.send_multipart(frames)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            if self._sock is not None and self.session is not None:
                self._sock.send_multipart(self._codec.encode(Goodbye()))
            self._pinger.cancel()
            self._reader.cancel()
            if self._sock is not None:
                self._sock.close(linger=0)
            if self._ctx is not None:
                self._ctx.term()

        try:
            self._run(shutdown()).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._notes.put(None)
            self._loop.close()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expect(reply: LocalMessage, kind: type[Any]) -> Any:
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, the daemon sent {type(reply).__name__}")
    return reply
