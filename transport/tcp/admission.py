"""Who may hold a data connection on this node, and how the listener weathers abuse.

`Admission` keeps the receive streams: at most `max_unauthenticated` of them not yet
authenticated (hello, and where tcp security is on the ticket proof; past it a new
connection takes the place of the oldest such, so that a host holding that many silent
connections open cannot shut real writers out, who authenticate within a round trip or
two), at most
`max_streams_per_peer` per node by its authenticated name (checked once the handshake has
proven it), and none opened before a fence of its node (see `Transport.fence`). `Backoff`
paces the listener when `accept` fails for want of descriptors or memory, with one log line
per interval instead of one per failure.
"""

from __future__ import annotations

import errno
import threading
import time

import structlog

from weightwire.protocol.errors import ErrorCode, PeerLostError, WeightwireError

from .incoming import Gate, IncomingStream

log = structlog.get_logger("weightwire.transport.tcp")

PAUSE_S = (0.05, 1.0)  # first and longest pause of the listener after a failed accept
LOG_EVERY_S = 10.0  # at most one line per interval about refused connections or accepts


class Admission(Gate):
    """The receive streams of a node (their threads end them, hence the lock)."""

    def __init__(self, max_unauthenticated: int, max_streams_per_peer: int) -> None:
        self.max_unauthenticated = max_unauthenticated
        self.max_streams_per_peer = max_streams_per_peer
        self._lock = threading.Lock()
        self._streams: set[IncomingStream] = set()
        self._accepted = 0  # connections taken so far; numbers them, for fences
        self._fenced_at: dict[str, int] = {}  # node -> _accepted at its last fence
        self.refused = 0
        self._log = Limited()
        # lines about peers, of each kind at most one per interval for each authenticated
        # node and one for all connections not authenticated: a host connecting in a loop to send
        # garbage logged a warning per connection (833 in 3 s)
        self._peer_logs: dict[tuple[str | None, str], Limited] = {}

    def number(self, address: str) -> int | None:
        """A number for a connection just accepted (None: it may not wait at all). Past
        `max_unauthenticated` waiting, the oldest waiting is closed to make room: refusing
        the new one let a host that kept that many silent connections open shut every
        writer out."""
        with self._lock:
            waiting = [s for s in self._streams if not s.greeted]
            if self.max_unauthenticated <= 0:
                self.refused += 1
                return None
            oldest = (
                min(waiting, key=lambda s: s.number)
                if len(waiting) >= self.max_unauthenticated
                else None
            )
            if oldest is not None:
                self._streams.discard(oldest)  # no longer counted; its thread ends it
                self.refused += 1
            self._accepted += 1
            number = self._accepted
        if oldest is not None:
            oldest.close()
            self._log.warning(
                "tcp data connection not authenticated in time for a new one; closed",
                address=oldest.address,
                limit=self.max_unauthenticated,
            )
        return number

    def add(self, stream: IncomingStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def hello(self, stream: IncomingStream) -> WeightwireError | None:
        """Called once the stream's peer is authenticated (`stream.peer` is its proven name)."""
        node = stream.peer
        with self._lock:
            if stream.number <= self._fenced_at.get(node, 0):
                return PeerLostError(f"connection from {node} predates a fence of it")
            same = sum(1 for s in self._streams if s.machine.peer == node)
        if same > self.max_streams_per_peer:
            return WeightwireError(
                f"{node} already has {self.max_streams_per_peer} data connections here",
                code=ErrorCode.TOO_LARGE,
            )
        return None

    def ended(self, stream: IncomingStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def warn(self, stream: IncomingStream, event: str, **fields: object) -> None:
        who = stream.machine.peer
        with self._lock:
            limited = self._peer_logs.setdefault((who, event), Limited())
        limited.warning(event, **{"peer": stream.peer, **fields})

    def fence(self, node: str) -> list[IncomingStream]:
        """`node`'s streams, to close; any it opened before now is refused at its hello."""
        with self._lock:
            self._fenced_at[node] = self._accepted
            return [s for s in self._streams if s.machine.peer == node]

    def take_all(self) -> list[IncomingStream]:
        with self._lock:
            streams = list(self._streams)
            self._streams.clear()
        return streams

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)


class Backoff:
    """How long the listener pauses after each failed accept: 50 ms, doubling to 1 s,
    back to nothing after one that works."""

    def __init__(self) -> None:
        self.pause_s = 0.0
        self.failures = 0
        self._log = Limited()

    def failed(self, exc: Exception) -> float:
        """After an accept that failed, or a connection no thread could be started for."""
        self.failures += 1
        self.pause_s = min(PAUSE_S[1], max(PAUSE_S[0], self.pause_s * 2))
        number = exc.errno if isinstance(exc, OSError) else None
        self._log.warning(
            "tcp accept failed; pausing the listener",
            error=str(exc),
            errno=errno.errorcode.get(number or 0, str(number)),
            pause_s=self.pause_s,
        )
        return self.pause_s

    def ok(self) -> None:
        self.pause_s = 0.0


class Limited:
    """A warning at most once per interval, saying how many were left out meanwhile."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last = -every_s
        self._left_out = 0
        self._lock = threading.Lock()

    def warning(self, event: str, **fields: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s:
                self._left_out += 1
                return
            left_out, self._left_out, self._last = self._left_out, 0, now
        log.warning(event, left_out=left_out, **fields)
