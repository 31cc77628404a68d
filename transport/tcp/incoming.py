"""The receiving end of one tcp data connection (the sending end: `streams.py`): writes
straight into region memory with `recv_into`, on a thread of its own; acks, refusals and
immediates back to the event loop with `call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from weightwire.protocol.errors import ErrorCode, RegionError, WeightwireError
from weightwire.transport.tcp.data import Write

from . import wire
from .streams import shutdown_socket

log = structlog.get_logger("weightwire.transport.tcp")


class Gate:
    """What a receive stream asks its transport: may this peer go on (None) or not (why).
    `hello` is asked once the peer is authenticated (the handshake's proof checked)."""

    def hello(self, stream: IncomingStream) -> WeightwireError | None:
        return None

    def ended(self, stream: IncomingStream) -> None:
        pass

    def warn(self, stream: IncomingStream, event: str, **fields: object) -> None:
        """A line about the stream's peer: anyone who reaches the port can make these in a
        loop, so a gate may throttle them."""
        log.warning(event, **fields)


@dataclass(eq=False)
class IncomingStream:
    """Receives writes from one peer over one connection, straight into region memory."""

    sock: socket.socket
    address: str
    loop: asyncio.AbstractEventLoop
    machine: wire.ReceiveMachine
    on_imm: Callable[[int, str], None]
    stall_timeout_s: float
    on_received: Callable[[int], None]
    on_refused: Callable[[], None]
    handshake_timeout_s: float = 10.0
    gate: Gate = field(default_factory=Gate)
    number: int = 0  # order of acceptance, for fences
    release: Callable[[], None] | None = None  # once the thread has ended (the sink's bounce)
    _closed: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _accepted: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        """RuntimeError when no thread can be started (the caller closes the socket)."""
        thread = threading.Thread(target=self._run, name=f"ww-tcp-recv-{self.address}", daemon=True)
        thread.start()
        self._thread = thread

    @property
    def peer(self) -> str:
        return self.machine.peer or self.address

    @property
    def greeted(self) -> bool:
        return self.machine.peer is not None

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            shutdown_socket(self.sock)
            self.sock.close()  # the fd goes with the thread, whoever else holds the stream
            if self.release is not None:  # nothing lands through the sink any more
                self.release()
            self.gate.ended(self)

    def _serve(self) -> None:
        m = self.machine
        frame_started = time.monotonic()  # when the frame under way began to arrive
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if m.peer is None and now - self._accepted > self.handshake_timeout_s:
                    self.gate.warn(
                        self,
                        "tcp data connection not authenticated in time; closing",
                        address=self.address,
                        timeout_s=self.handshake_timeout_s,
                    )
                    return
                if m.mid_frame and now - frame_started > self.stall_timeout_s:
                    # A frame must be whole within stall_timeout_s of its first byte, not
                    # merely see a byte that often: a peer trickling one byte every 0.4 s
                    # held its write (and this thread) open for ever. The writer fails a
                    # write not acknowledged within the same time, so no honest frame
                    # takes longer.
                    self.gate.warn(
                        self,
                        "tcp peer stalled mid-frame; closing",
                        peer=self.peer,
                        frame_s=round(now - frame_started, 3),
                    )
                    return
                try:
                    # the whole stage at once (up to a record) in one call: the kernel
                    # waits for it, not a Python loop per segment (SO_RCVTIMEO still ends
                    # the wait with what came, or with EAGAIN when nothing did)
                    n = self.sock.recv_into(m.buffer(), 0, socket.MSG_WAITALL)
                except (BlockingIOError, TimeoutError):
                    if not m.mid_frame:
                        frame_started = time.monotonic()
                    continue
                except OSError as exc:
                    under = m.write
                    if exc.errno != errno.EFAULT or under is None:
                        raise
                    # the kernel found no page where the write lands: its region's file
                    # was shrunk under the mapping (a store here would have been a SIGBUS)
                    why = RegionError(
                        f"write {under.seq} into region {under.region}: its memory is gone "
                        "(the rank's file shrank under the daemon's mapping)",
                        code=ErrorCode.OUT_OF_BOUNDS,
                    )
                    self._refuse(wire.FrameViolation(why, under.seq))
                    return
                if n == 0:
                    return
                if not m.mid_frame:
                    frame_started = time.monotonic()
                try:
                    event = m.received(n)
                    if isinstance(event, wire.HelloReceived):
                        refusal = self.gate.hello(self)
                        if refusal is not None:
                            raise wire.FrameViolation(refusal, 0)
                except wire.FrameViolation as v:
                    self._refuse(v)
                    return
                if isinstance(event, wire.Reply):
                    self.sock.sendall(event.data)
                elif isinstance(event, wire.Landed):
                    w: Write = event.write
                    self.on_received(w.length)
                    if w.imm >= 0:
                        self.loop.call_soon_threadsafe(self.on_imm, w.imm, self.peer)
                    self.sock.sendall(m.reply(wire.ack(w.seq)))
        except OSError as exc:
            if not self._closed.is_set():
                log.info("tcp receive stream ended", peer=self.peer, error=str(exc))
        except RuntimeError:  # loop closed during shutdown
            pass

    def _refuse(self, v: wire.FrameViolation) -> None:
        """Tell the peer why (its `Refused` frame), then close the connection."""
        self.on_refused()
        self.gate.warn(
            self,
            "tcp write refused; closing connection",
            peer=self.peer,
            code=v.code.value,
            error=v.message,
            seq=v.seq,
        )
        self.sock.sendall(self.machine.reply(wire.refused(v.seq, v)))
        self._linger()

    def _linger(self, limit_s: float = 2.0) -> None:
        """Half-close and discard what the peer still sends until it closes too.

        Closing with unread bytes queued makes the kernel send RST, which can destroy the
        Refused frame before the peer reads it.
        """
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        sink = bytearray(1 << 16)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not self._closed.is_set():
            try:
                if self.sock.recv_into(sink) == 0:
                    return
            except (BlockingIOError, TimeoutError):
                continue
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        shutdown_socket(self.sock)

    def join(self, timeout: float) -> bool:
        """Wait for the receiving thread; True once it has ended (nothing more lands)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


__all__ = ["Gate", "IncomingStream"]
