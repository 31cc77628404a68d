"""File descriptors from the ranks of this host to the daemon: SCM_RIGHTS over a Unix
datagram socket, each batch under a random token that a later request names.

The local socket is ZeroMQ, which cannot carry descriptors, so a rank that must hand the
daemon some (GPU memory exported as POSIX fds: `memory.vmm`) first sends them here with
`send`, then names the token in its request; the daemon `claim`s them. A datagram that
`send` returned from is already in the daemon's queue, so a claim made after the request
arrives finds it. Descriptors nobody claims are closed after `ttl_s`, and the oldest
beyond MAX_PENDING_FDS at once (a rank cannot run the daemon out of descriptors). The
daemon drains the socket as datagrams arrive (`drain`, from its event loop): the kernel
queues only a few datagrams (net.unix.max_dgram_qlen), and batches left there unclaimed
blocked every other rank's `send`.
"""

from __future__ import annotations

import array
import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

TOKEN_BYTES = 16
MAX_FDS = 250  # SCM_MAX_FD is 253
MAX_PENDING_FDS = 1024  # descriptors waiting to be claimed; beyond it the oldest are closed


class FdPassError(Exception):
    pass


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def send(path: str, token: bytes, fds: list[int], timeout_s: float = 10.0) -> None:
    """Hand `fds` (duplicated by the kernel; the caller's copies stay open) to the inbox at
    `path` under `token`."""
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a token has {TOKEN_BYTES} bytes, not {len(token)}")
    if not 0 < len(fds) <= MAX_FDS:
        raise ValueError(f"1 to {MAX_FDS} descriptors at a time, not {len(fds)}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            # (socket.send_fds ignores its address argument: sendmsg directly)
            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))
            sock.sendmsg([token], [rights], 0, path)
        except OSError as exc:
            raise FdPassError(
                f"could not pass {len(fds)} file descriptor(s) to the daemon at {path}: {exc}"
            ) from None


class Inbox:
    """The daemon's end: bound at `path` with mode `mode`; thread-safe."""

    def __init__(
        self,
        path: str,
        mode: int = 0o660,
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[float, list[int]]] = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        old = os.umask(0o777 & ~mode)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        self._sock: socket.socket | None = sock

    def claim(self, token: bytes) -> list[int]:
        """The descriptors sent under `token` (now the caller's to close); FdPassError if
        none were."""
        with self._lock:
            self._drain()
            found = self._pending.pop(token, None)
        if found is None:
            raise FdPassError(
                "no file descriptors were passed under this token (sent to another daemon's "
                f"{self.path}?, or more than {self.ttl_s:.0f} s ago)"
            )
        return found[1]

    def fileno(self) -> int:
        """The socket's descriptor, to watch for datagrams (-1: closed)."""
        return self._sock.fileno() if self._sock is not None else -1

    def drain(self) -> None:
        """Take what has arrived (closing what is too old or too much): thread-safe."""
        with self._lock:
            if self._sock is not None:
                self._drain()

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            raise FdPassError("the descriptor inbox is closed")
        now = self._clock()
        held = sum(len(fds) for _, fds in self._pending.values())
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, TOKEN_BYTES + 1, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                break
            if len(msg) != TOKEN_BYTES or not fds or msg in self._pending:
                _close(fds)  # not ours, or a replayed token: never mix batches
                continue
            self._pending[msg] = (now, fds)
            held += len(fds)
            held = self._trim(now, held)  # as they come: never more than one batch over
        self._trim(now, held)

    def _trim(self, now: float, held: int) -> int:
        for token, (at, fds) in list(self._pending.items()):  # oldest first
            if now - at > self.ttl_s or held > MAX_PENDING_FDS:
                del self._pending[token]
                held -= len(fds)
                _close(fds)
        return held

    def pending(self) -> int:
        with self._lock:
            self._drain()
            return len(self._pending)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(FdPassError):
                    self._drain()
                self._sock.close()
                self._sock = None
            for _, fds in self._pending.values():
                _close(fds)
            self._pending.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _close(fds: list[int] | array.array[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
