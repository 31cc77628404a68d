"""A rank's connection to its daemon: synchronous calls, replies read on a background thread.

One DEALER socket, owned by a lock rather than by a thread: ZeroMQ sockets are not thread
safe, but may move between threads with a full memory barrier between uses (the zmq
guide), which the lock gives. The caller's thread encodes and sends its request itself
(no hop to another thread on the way out) and waits on a `concurrent.futures.Future`;
the connection's loop thread watches the socket's file descriptor and, on each edge,
reads every message queued (non-blocking, under the lock), handing a reply straight to
its waiter's future and a notification to the notify thread. ZeroMQ's descriptor is
edge-triggered and any operation on the socket may consume the edge, so a send that
finds input queued afterwards wakes the reader itself. Notifications (version complete,
publish result) are handed to callbacks on a thread of their own, so a slow callback
never stalls the connection.
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
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec
import zmq

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
        inline: Callable[[LocalMessage], bool] | None = None,
        ping_interval_s: float = 1.0,
        lost_after_s: float = 5.0,
    ) -> None:
        self.path = path or DEFAULT_SOCKET
        if not os.path.exists(self.path) and os.path.exists(self.path + ".full"):
            raise ProtocolError(
                f"the daemon at {self.path} takes no new connection now: it is near its "
                f"file descriptor limit (its socket is set aside as {self.path}.full until "
                f"descriptors are free); connect again later",
                code=ErrorCode.BUSY,
            )
        if not os.path.exists(self.path):
            raise NoDaemonError(
                f"no daemon socket at {self.path} (is weightwired running? "
                f"set WEIGHTWIRE_SOCKET or pass socket=)"
            )
        self._codec: Codec[LocalMessage] = Codec(LocalMessage, max_bytes=1 << 30)
        self._reqs = itertools.count(1)
        self._pending: dict[int, Future[LocalMessage]] = {}
        self._sock_lock = threading.Lock()  # every use of the socket holds it
        self._read_at: dict[int, float] = {}
        # perf_counter points of the last request of each kind: called, sent, reply read, woke
        self.last_traces: dict[type, tuple[float, float, float, float]] = {}
        self._on_notify = on_notify
        self._on_reset = on_reset  # the daemon restarted and forgot us: register again
        self._on_lost = on_lost  # the daemon has not answered for `lost_after_s`
        # notifications taken on the socket's own thread as they are read (True: taken),
        # one thread hop sooner than `on_notify`: quick and never blocking, or not at all
        self._inline = inline
        self._ping_interval_s = ping_interval_s
        self.lost_after_s = lost_after_s
        self.last_answer = time.monotonic()
        self.lost = False
        self.session: str | None = None
        self._epoch = 0  # counts sessions established (each Welcome)
        self.region_dir = SHM_DIR  # where the daemon maps rank region files from (Welcome)
        self.fd_socket = ""  # where the daemon takes file descriptors (Welcome; "": nowhere)
        self.features: frozenset[str] = frozenset()  # what the daemon does (Welcome)
        self.max_message_bytes = 0  # the daemon's limit on a request (Welcome; 0: unknown)
        self._reset_lock = threading.Lock()
        self._notes: queue.SimpleQueue[LocalMessage | None] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ww-conn", daemon=True)
        self._thread.start()
        self._notifier = threading.Thread(target=self._deliver, name="ww-notify", daemon=True)
        self._notifier.start()
        self._sock: zmq.Socket[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._closed = False
        self._run(self._open()).result(10)

    def _run(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.path}")
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._read)
        self._pinger = loop.create_task(self._ping())

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

    def _read(self) -> None:
        """Every message queued on the socket (the loop thread, on the descriptor's edge)."""
        while True:
            with self._sock_lock:
                if self._sock is None or self._sock.closed:
                    return
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
            try:
                msg, _ = self._codec.decode(frames)
            except ProtocolError:
                continue
            fut = self._pending.pop(msg.req, None) if msg.req else None
            if fut is not None:
                self._read_at[msg.req] = time.perf_counter()
                if not fut.done():
                    fut.set_result(msg)  # wakes the caller's thread directly
            elif not self._take_inline(msg):
                self._notes.put(msg)

    def _take_inline(self, msg: LocalMessage) -> bool:
        if self._inline is None:
            return False
        try:
            return self._inline(msg)
        except Exception as exc:  # the reader must go on; the delivery thread gets it
            print(f"weightwire: an inline notification failed: {exc!r}", file=sys.stderr)
            return False

    def _send_frames(self, frames: list[Any], timeout_s: float) -> None:
        """Send from the calling thread, under the socket's lock. A full queue (the daemon not
        reading) is retried outside the lock until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._sock_lock:
                if self._sock is None or self._closed:
                    raise WeightwireError("the connection is closed", code=ErrorCode.PEER_LOST)
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK)
                    # the send may have consumed the descriptor's edge for input queued
                    # meanwhile: then the reader would not wake for it
                    readable = bool(int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
                    break
                except zmq.Again:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError_(
                    f"the daemon at {self.path} took no request within {timeout_s:.0f} s"
                )
            time.sleep(0.001)
        if readable:
            self._loop.call_soon_threadsafe(self._read)

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
                try:
                    self._on_notify(msg)
                except Exception as exc:  # this thread delivers every later notification
                    print(f"weightwire: a notification failed: {exc!r}", file=sys.stderr)

    def _start(self, msg: LocalMsg, timeout_s: float) -> tuple[int, Future[LocalMessage]]:
        """Send a request from the calling thread; its reply comes to the future."""
        req = next(self._reqs)
        fut: Future[LocalMessage] = Future()
        self._pending[req] = fut
        try:
            self._send_frames(self._encode(msgspec.structs.replace(msg, req=req)), timeout_s)
        except BaseException:
            self._pending.pop(req, None)
            raise
        return req, fut

    def _timeout(self, msg: LocalMsg, timeout_s: float) -> TimeoutError_:
        return TimeoutError_(
            f"the daemon at {self.path} did not answer {type(msg).__name__} within "
            f"{timeout_s:.0f} s"
        )

    async def _request(self, msg: LocalMsg, timeout_s: float) -> LocalMessage:
        """`_call` for the loop thread (its pings)."""
        req, fut = self._start(msg, timeout_s)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except TimeoutError:
            raise self._timeout(msg, timeout_s) from None
        finally:
            self._pending.pop(req, None)

    def _call(self, msg: LocalMsg, timeout_s: float) -> LocalMessage:
        t0 = time.perf_counter()
        req, fut = self._start(msg, timeout_s)
        sent = time.perf_counter()
        try:
            reply = fut.result(timeout_s)
        except FutureTimeout:
            raise self._timeout(msg, timeout_s) from None
        finally:
            self._pending.pop(req, None)
        self.last_traces[type(msg)] = (t0, sent, self._read_at.pop(req, sent), time.perf_counter())
        return reply

    def request(self, msg: LocalMsg, timeout_s: float = 30.0) -> LocalMessage:
        """Send a request and return its reply; an `Error` reply is raised as its exception.

        If the daemon no longer knows this session (it restarted), the owner's `on_reset`
        registers everything again and the request is sent once more.
        """
        if self._closed:
            raise WeightwireError("the connection is closed", code=ErrorCode.PEER_LOST)
        epoch = self._epoch
        reply = self._call(msg, timeout_s)
        forgotten = isinstance(reply, Error) and reply.code == ErrorCode.NO_SESSION.value
        if forgotten and self._on_reset is not None and not isinstance(msg, Hello):
            self.reset(epoch)
            reply = self._call(msg, timeout_s)
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if isinstance(reply, Welcome):
            self.session = reply.session
            self.region_dir = reply.region_dir or SHM_DIR
            self.fd_socket = reply.fd_socket
            self.features = frozenset(reply.features)
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

        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(exc)

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
            shared.detach()
            shared.close()
            raise

    def send(self, msg: LocalMsg, timeout_s: float = 30.0) -> None:
        """Send without waiting for a reply, from the calling thread (messages keep their
        order: one thread's sends are in the order it made them)."""
        self._send_frames(self._encode(msg), timeout_s)

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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            self._pinger.cancel()
            with self._sock_lock:
                if self._sock is None:
                    return
                asyncio.get_running_loop().remove_reader(self._fd)
                if self.session is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sock.send_multipart(self._codec.encode(Goodbye()), zmq.NOBLOCK)
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
