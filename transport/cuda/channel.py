"""The channel between the cuda transports of different daemons on one host: a Unix
datagram socket each, carrying the immediates of copies that landed ("I") and goodbyes
("B"). Transports of one process skip it and call each other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
import tempfile
from collections.abc import Callable, Iterable

_IMM = struct.Struct("<I")


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

    def send_imms(self, path: str, source: str, imms: Iterable[int]) -> None:
        if self._sock is None:
            return
        name = source.encode()
        for imm in imms:
            with contextlib.suppress(OSError):  # a peer gone meanwhile: its goodbye follows
                self._sock.sendto(b"I" + _IMM.pack(imm) + name, path)

    def send_bye(self, path: str, source: str) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendto(b"B" + source.encode(), path)

    def _readable(self, on_imm: Callable[[int, str], None], on_bye: Callable[[str], None]) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(4096)
            except BlockingIOError:
                return
            kind, body = data[:1], data[1:]
            if kind == b"I" and len(body) > _IMM.size:
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
