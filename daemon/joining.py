"""Why this node has not joined the cluster yet, said once per interval.

A node that never hears a welcome from the coordinator used to say nothing. `JoinWatch`
reads the ZeroMQ events of the socket to the coordinator (connection refused, a CURVE
handshake the coordinator refused or could not complete) and the coordinator's own
refusals (a protocol version it does not speak), and logs the likeliest cause while the
node waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .lograte import Throttled

log = structlog.get_logger("weightwire.daemon")

GRACE_S = 3.0  # joining normally takes one round trip; say nothing before this
_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_MONITOR_STOPPED
)


def _close(sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket) -> None:
    with contextlib.suppress(Exception):
        sock.disable_monitor()
    mon.close(linger=0)


class JoinWatch:
    def __init__(self, coordinator: str, node: str, public_key: str, interval_s: float) -> None:
        self.coordinator = coordinator
        self.node = node
        self.public_key = public_key
        self.since = time.monotonic()
        self.joined = False
        self.connected = False
        self.reason = ""
        self.refused_key = False
        self._throttle = Throttled(interval_s)
        self._monitors: asyncio.Queue[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]] = (
            asyncio.Queue()
        )

    @property
    def waiting_for(self) -> str:
        why = self.reason or (
            "connected, no answer yet"
            if self.connected
            else "no connection yet (is it running, and reachable from here?)"
        )
        return f"waiting to join the coordinator at {self.coordinator}: {why}"

    def attach(self, sock: zmq.asyncio.Socket) -> None:
        """Watch this (new) coordinator socket: called before anything is sent on it, so
        that no event of its first handshake is missed."""
        self._monitors.put_nowait((sock, sock.get_monitor_socket(_EVENTS)))

    async def watch(self) -> None:
        """Reads the events of the attached sockets, one after the other (a socket's monitor
        stops when it is closed), until cancelled."""
        try:
            while True:
                sock, mon = await self._monitors.get()
                try:
                    while True:
                        ev = parse_monitor_message(await mon.recv_multipart())
                        if ev["event"] == zmq.EVENT_MONITOR_STOPPED:
                            break
                        self._event(ev)
                finally:
                    _close(sock, mon)
        finally:
            while not self._monitors.empty():
                _close(*self._monitors.get_nowait())

    def _event(self, ev: Mapping[str, Any]) -> None:
        kind = ev["event"]
        if kind == zmq.EVENT_CONNECTED:
            self.connected = True
        elif kind == zmq.EVENT_DISCONNECTED:
            self.connected = False
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.reason = ""
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            # ZeroMQ will not retry this socket: a new one each hello until joined (sticky: the
            # new socket's own events may come before its monitor is attached)
            self.refused_key = True
            self.reason = (
                f"the coordinator refused this node's CURVE key {self.public_key} "
                f"(status {ev['value']}): put {self.node}'s public key file in the "
                f"coordinator's curve_allowed_keys_dir (or curve_allowed_keys), then SIGHUP it"
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.reason = (
                "the CURVE handshake failed: coordinator_public_key is probably not the "
                "coordinator's public key (or one side runs with insecure = true)"
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.reason = f"the coordinator's ZeroMQ handshake failed ({ev['value']})"

    def refused(self, code: str, message: str) -> None:
        """The coordinator answered with an error instead of a welcome."""
        self.reason = f"the coordinator refused: [{code}] {message}"

    def check(self, now: float | None = None) -> None:
        """Called each tick while not joined: logs why, at most once per interval."""
        now = time.monotonic() if now is None else now
        if self.joined or now - self.since < GRACE_S:
            return
        self._throttle.emit(
            log.warning,
            "cannot join",
            coordinator=self.coordinator,
            waited_s=round(now - self.since, 1),
            reason=self.waiting_for,
        )

    def on_joined(self) -> None:
        self.joined = True
        self.refused_key = False
        self.reason = ""

    def on_left(self) -> None:
        if self.joined:
            self.joined = False
            self.since = time.monotonic()
