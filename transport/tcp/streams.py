"""The sending end of one tcp data connection, driven by threads of its own (the receiving
end: `incoming.py`).

Sockets are blocking with kernel timeouts (SO_SNDTIMEO/SO_RCVTIMEO), so payloads move
with `os.sendfile` from the source region's file and `recv_into` the destination
region: the kernel does all the copying and the GIL is released while it does.
Completions go back to the event loop with `call_soon_threadsafe`. A GPU source goes
through a bounded pinned buffer, piece by piece (bounce.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    RegionError,
    TimeoutError_,
    TransferError,
    WeightwireError,
    error_from_code,
)
from weightwire.transport.base import LocalRegion
from weightwire.transport.tcp.data import MAX_HEADER, PREFIX, Ack, Refused

from . import auth, wire
from .bounce import DEFAULT_CAP, Bounce, Pinned, pieces

log = structlog.get_logger("weightwire.transport.tcp")

TICK_S = 0.5  # how often a blocked thread wakes to check for stalls and shutdown
READ_BYTES = 4 * auth.RECORD  # a host source read at a time to encrypt (`_send_read`)


def tune(sock: socket.socket, send_timeout_s: float) -> None:
    sock.setblocking(True)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sec = int(send_timeout_s)
    sock.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_SNDTIMEO,
        struct.pack("ll", sec, int((send_timeout_s - sec) * 1e6)),
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, int(TICK_S * 1e6)))


@dataclass(eq=False, slots=True)
class Pending:
    seq: int
    future: asyncio.Future[None]
    header: bytes
    src: LocalRegion
    src_offset: int
    length: int


@dataclass(eq=False)
class OutgoingStream:
    """Sends writes to one peer over one connection; a second thread reads the acks."""

    node: str
    sock: socket.socket
    loop: asyncio.AbstractEventLoop
    stall_timeout_s: float
    on_sent: Callable[[int], None]
    inflight: dict[int, Pending] = field(default_factory=dict)
    outstanding_bytes: int = 0
    dead: BaseException | None = None
    send_error: BaseException | None = None
    _queue: queue.SimpleQueue[Pending | None] = field(default_factory=queue.SimpleQueue)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)
    _last_progress: float = field(default_factory=time.monotonic)
    _threads: list[threading.Thread] = field(default_factory=list)
    _bounce: Bounce | None = None  # pinned host memory for GPU sources (made on first use)
    bounce_bytes: int = DEFAULT_CAP  # the most it holds; larger writes go in pieces
    pinned: Pinned | None = None  # the transport's count of pinned bytes
    _running: int = 0
    channel: auth.Channel | None = None  # the authenticated connection's keys (None: plain)
    _scratch: memoryview | None = None  # one encrypted record (made on first use)
    _plain: memoryview | None = None  # a host source's bytes read to encrypt (first use)

    def start(self) -> None:
        self._running = 2
        for target, role in ((self._send_loop, "send"), (self._ack_loop, "ack")):
            t = threading.Thread(
                target=self._thread, args=(target,), name=f"ww-tcp-{role}-{self.node}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _thread(self, body: Callable[[], None]) -> None:
        """Runs one of the stream's two loops; the last to end releases the socket."""
        try:
            body()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                if self.dead is None:
                    self.fail(PeerLostError(f"connection to {self.node} ended"))
                self.sock.close()
                if self._bounce is not None:  # no thread copies through it any more
                    self._bounce.close()

    def submit(self, pending: Pending) -> None:
        with self._lock:
            if self.dead is not None:
                raise PeerLostError(f"connection to {self.node} is down: {self.dead}")
            if not self.inflight:
                self._last_progress = time.monotonic()
            self.inflight[pending.seq] = pending
            self.outstanding_bytes += pending.length
        self._queue.put(pending)

    def _send_loop(self) -> None:
        while True:
            p = self._queue.get()
            if p is None or self.dead is not None:
                return
            try:
                if self.channel is None:
                    self._send_plain(p)
                else:
                    self._send_sealed(p, self.channel.send)
                self.on_sent(p.length)
            except BlockingIOError:
                self.fail(
                    TimeoutError_(
                        f"send to {self.node} made no progress for {self.stall_timeout_s:.0f} s"
                    )
                )
                return
            except (OSError, WeightwireError) as exc:
                # The peer may have refused a write and closed: let the ack reader take its
                # Refused frame (the precise reason) before the stream is failed.
                self.send_error = exc
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)
                return

    def _send_plain(self, p: Pending) -> None:
        self.sock.sendall(p.header, socket.MSG_MORE)
        if p.src.kind == "gpu":
            for start, piece in self._from_gpu(p):
                self.sock.sendall(piece, socket.MSG_MORE if start + len(piece) < p.length else 0)
        elif p.src.fd is not None:
            self._sendfile(p.src.fd, p.src_offset, p.length)
        else:
            assert p.src.view is not None
            self.sock.sendall(p.src.view[p.src_offset : p.src_offset + p.length])

    def _send_sealed(self, p: Pending, sealer: auth.Sealer) -> None:
        """Header and tag, then the payload record by record, each with its tag (AUTH: the
        bytes go in clear) or encrypted (ENCRYPT)."""
        self.sock.sendall(wire.seal(p.header, sealer), socket.MSG_MORE)
        if p.length == 0:
            return
        if p.src.kind == "gpu":
            for start, piece in self._from_gpu(p):  # whole records: the same records
                self._send_records(piece, start, p.length, sealer)
        elif p.src.view is not None and sealer.encrypts and p.src.fd is not None:
            self._send_read(p, sealer)
        elif p.src.view is not None:
            view = p.src.view[p.src_offset : p.src_offset + p.length]
            self._send_records(view, 0, p.length, sealer)
        else:
            raise TransferError(f"region {p.src.id} has no host view to authenticate from")

    def _send_records(self, view: memoryview, at: int, length: int, sealer: auth.Sealer) -> None:
        """`view` (the payload's bytes from `at` on, of `length` in all) record by record."""
        for start in range(0, len(view), auth.RECORD):
            record = view[start : start + auth.RECORD]
            more = socket.MSG_MORE if at + start + auth.RECORD < length else 0
            if sealer.encrypts:
                if self._scratch is None:
                    self._scratch = memoryview(bytearray(auth.RECORD + auth.TAG))
                self.sock.sendall(sealer.encrypt_record(record, self._scratch), more)
                continue
            # sendall, not sendfile: sendfile of 1 MiB records between tags halved the rate
            # (measured on loopback: 10-12 against 24 Gbit/s)
            self.sock.sendall(record, socket.MSG_MORE)
            self.sock.sendall(sealer.record_tag(record), more)

    def _send_read(self, p: Pending, sealer: auth.Sealer) -> None:
        """A rank's shared file, encrypted: read with `preadv` into a buffer of this
        stream's own, never loaded from the mapping, which the rank can shrink under the
        daemon (a load past the new end is a SIGBUS; a short read here is an error)."""
        assert p.src.fd is not None
        if self._plain is None:
            self._plain = memoryview(bytearray(READ_BYTES))
        for start in range(0, p.length, READ_BYTES):
            n = min(READ_BYTES, p.length - start)
            got = os.preadv(p.src.fd, [self._plain[:n]], p.src_offset + start)
            if got < n:
                raise RegionError(
                    f"region {p.src.id} of {p.src.owner}: its file ends before byte "
                    f"{p.src_offset + start + n} of the {p.src.length} registered (shrunk "
                    "under the daemon by a process that can open it)",
                    code=ErrorCode.OUT_OF_BOUNDS,
                )
            self._send_records(self._plain[:n], start, p.length, sealer)

    def _from_gpu(self, p: Pending) -> Iterator[tuple[int, memoryview]]:
        """The payload piece by piece through the bounce: (offset, bytes), each good until
        the next is asked for."""
        assert p.src.device is not None
        if self._bounce is None:
            self._bounce = Bounce(self.bounce_bytes, self.stall_timeout_s, self.pinned)
        src = p.src.address + p.src_offset
        for start, n in pieces(p.length, self._bounce.cap):
            yield start, self._bounce.from_device(p.src.device, src + start, n)

    def _sendfile(self, src_fd: int, off: int, left: int) -> None:
        fd = self.sock.fileno()
        while left:
            n = os.sendfile(fd, src_fd, off, left)
            if n == 0:
                raise PeerLostError("sendfile made no progress")
            off += n
            left -= n

    def _ack_loop(self) -> None:
        prefix = bytearray(PREFIX.size)
        header = bytearray(MAX_HEADER + auth.TAG)
        opener = self.channel.receive if self.channel is not None else None
        extra = auth.TAG if opener is not None else 0
        while not self._closed.is_set():
            try:
                self._recv_ticking(memoryview(prefix))
                kind, hlen = wire.decode_prefix(prefix)
                sealed = memoryview(header)[: hlen + extra]
                self._recv_ticking(sealed)
                body = opener.header(memoryview(prefix), sealed) if opener else sealed
                msg = wire.decode_header(kind, body)
            except WeightwireError as problem:
                cause: WeightwireError = problem
                if self.send_error is not None:
                    cause = PeerLostError(f"send to {self.node} failed: {self.send_error}")
                elif not isinstance(problem, PeerLostError | TimeoutError_):
                    cause = PeerLostError(f"bad frame from {self.node}: {problem}")
                self.fail(cause)
                return
            except OSError as exc:
                self.fail(PeerLostError(f"connection to {self.node} failed: {exc}"))
                return
            match msg:
                case Ack(seq=seq):
                    self._settle(seq, None)
                case Refused(seq=seq, code=code, message=message):
                    # The peer closes a stream after refusing on it: fail it now, so that no
                    # caller who sees this refusal can pick the dying stream again.
                    refusal = error_from_code(code, f"{self.node} refused: {message}")
                    if seq == 0:  # the connection itself (its hello): every write fails so
                        self.fail(refusal)
                        return
                    self.fail(
                        PeerLostError(f"{self.node} closed the stream after refusing a write"),
                        refused=(seq, refusal),
                    )
                    return
                case _:
                    self.fail(PeerLostError(f"unexpected {type(msg).__name__} from {self.node}"))
                    return

    def _recv_ticking(self, view: memoryview) -> None:
        while view:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, TimeoutError):
                if self._closed.is_set():
                    raise PeerLostError("connection closed locally") from None
                with self._lock:
                    stalled = bool(self.inflight) and (
                        time.monotonic() - self._last_progress > self.stall_timeout_s
                    )
                if stalled:
                    raise TimeoutError_(
                        f"no acknowledgement from {self.node} for {self.stall_timeout_s:.0f} s"
                    ) from None
                continue
            if n == 0:
                raise PeerLostError(f"connection closed by {self.node}")
            view = view[n:]

    def _settle(self, seq: int, exc: BaseException | None) -> None:
        with self._lock:
            p = self.inflight.pop(seq, None)
            if p is None:
                return
            self.outstanding_bytes -= p.length
            self._last_progress = time.monotonic()
        self._resolve(p.future, exc)

    def _resolve(self, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(_set_outcome, fut, exc)

    def fail(self, exc: BaseException, refused: tuple[int, BaseException] | None = None) -> None:
        """Mark the stream dead and fail every write in flight or queued with `exc`.

        `refused` is a write the peer refused, which fails with its own reason instead.
        """
        with self._lock:
            if self.dead is not None:
                return
            self.dead = exc
            pending = list(self.inflight.values())
            self.inflight.clear()
            self.outstanding_bytes = 0
        self._closed.set()
        shutdown_socket(self.sock)
        self._queue.put(None)
        for p in pending:
            own = refused is not None and p.seq == refused[0]
            self._resolve(p.future, refused[1] if refused is not None and own else exc)
        if not isinstance(exc, _LocalClose):
            log.warning("tcp stream failed", peer=self.node, error=str(exc))

    def close(self, reason: str) -> None:
        self.fail(_LocalClose(reason))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.sock.close()


class _LocalClose(PeerLostError):
    pass


def _set_outcome(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def shutdown_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


__all__ = ["OutgoingStream", "Pending", "tune"]
