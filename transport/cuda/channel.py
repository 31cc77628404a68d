"""The channel between the cuda transports of different daemons on one host: a Unix
datagram socket each, carrying the immediates of copies that landed and goodbyes ("B").
Transports of one process skip it and call each other.

A batch's immediates go together, up to `PER_DATAGRAM` in one datagram ("J": a count, the
immediates, the source's name). A receiver's queue holds few datagrams (the host's
`net.unix.max_dgram_qlen`, 10 by default), and one immediate per datagram overflowed it
whenever a batch of copies landed at once: `sendto` on the non-blocking socket raised
EAGAIN, the immediate was dropped, and the destination waited for a write that had landed
until its version timed out. A full queue is now waited out, up to `SEND_WAIT_S`; an
immediate that still cannot be sent is reported undelivered (the writes fail peer_lost),
never dropped unsaid."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Sequence

_IMM = struct.Struct("<I")
_COUNT = struct.Struct("<I")
PER_DATAGRAM = 4096  # immediates in one datagram (16 KiB of them)
RECV_BYTES = 1 + _COUNT.size + 4 * PER_DATAGRAM + 1024  # and a node name
SEND_WAIT_S = 1.0  # a receiver's full queue waited out this long at most


class Channel:
    def __init__(self, directory: str | None = None) -> None:
        self.path = os.path.join(
            directory or tempfile.gettempdir(), f"weightwire-cuda-{secrets.token_hex(6)}.sock"
        )
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(
        self,
        loop: asyncio.AbstractEventLoop,
        on_imm: Callable[[int, str], None],
        on_bye: Callable[[str], None],
    ) -> None:
        """Bind, and call on_imm(imm, source node) / on_bye(node) on the loop as they come."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        sock.bind(self.path)
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._readable, on_imm, on_bye)

    def send_imms(
        self, path: str, source: str, imms: Sequence[int], wait_s: float = SEND_WAIT_S
    ) -> bool:
        """Send `imms` (of writes from node `source`) to the channel at `path`; False when
        they could not all be: the peer is gone, or its queue stayed full for `wait_s`."""
        if self._sock is None:
            return False
        name = source.encode()
        for at in range(0, len(imms), PER_DATAGRAM):
            part = imms[at : at + PER_DATAGRAM]
            body = struct.pack(f"<{len(part)}I", *part)
            if not self._send(b"J" + _COUNT.pack(len(part)) + body + name, path, wait_s):
                return False
        return True

    def _send(self, datagram: bytes, path: str, wait_s: float) -> bool:
        assert self._sock is not None
        deadline = time.monotonic() + wait_s
        pause = 0.0001
        while True:
            try:
                self._sock.sendto(datagram, path)
                return True
            except BlockingIOError:  # the receiver's queue is full: it is reading
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
            except OSError:  # the peer is gone: its goodbye follows
                return False

    def send_bye(self, path: str, source: str) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendto(b"B" + source.encode(), path)

    def _readable(self, on_imm: Callable[[int, str], None], on_bye: Callable[[str], None]) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                return
            kind, body = data[:1], data[1:]
            if kind == b"J" and len(body) >= _COUNT.size:
                (count,) = _COUNT.unpack_from(body)
                end = _COUNT.size + 4 * count
                if count > PER_DATAGRAM or len(body) <= end:
                    continue  # not one of ours
                source = body[end:].decode(errors="replace")
                for (imm,) in _IMM.iter_unpack(body[_COUNT.size : end]):
                    on_imm(imm, source)
            elif kind == b"I" and len(body) > _IMM.size:  # one immediate (older daemons)
                (imm,) = _IMM.unpack_from(body)
                on_imm(imm, body[_IMM.size :].decode(errors="replace"))
            elif kind == b"B":
                on_bye(body.decode(errors="replace"))

    def close(self) -> None:
        if self._loop is not None and self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
