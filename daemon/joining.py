"""Why this node has not joined the cluster yet, said once per interval.

A node that never hears a welcome from the coordinator used to say nothing. `JoinWatch`
reads the ZeroMQ events of the socket to the coordinator (connection refused, a CURVE
handshake the coordinator refused or could not complete) and the coordinator's own
refusals (a protocol version it does not speak), and logs the likeliest cause while the
node waits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .lograte import Throttled

log = structlog.get_logger("weightwire.daemon")

GRACE_S = 3.0  # joining normally takes one round trip; say nothing before this


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

    @property
    def waiting_for(self) -> str:
        why = self.reason or (
            "connected, no answer yet"
            if self.connected
            else "no connection yet (is it running, and reachable from here?)"
        )
        return f"waiting to join the coordinator at {self.coordinator}: {why}"

    async def watch(self, socket: Callable[[], zmq.asyncio.Socket]) -> None:
        """Reads the events of the coordinator socket, `socket()`, until cancelled; follows
        it when it is replaced (see `refused_key`)."""
        while True:
            await self._watch(socket())

    async def _watch(self, sock: zmq.asyncio.Socket) -> None:
        """Until the socket closes (its monitor stops); closes the monitor."""
        mon = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_MONITOR_STOPPED
        )
        try:
            while True:
                ev = parse_monitor_message(await mon.recv_multipart())
                if ev["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._event(ev)
        finally:
            with contextlib.suppress(Exception):
                sock.disable_monitor()
            mon.close(linger=0)

    def _event(self, ev: dict[str, object]) -> None:
        kind = ev["event"]
        if kind == zmq.EVENT_CONNECTED:
            self.connected = True
        elif kind == zmq.EVENT_DISCONNECTED:
            self.connected = False
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.reason = ""
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused_key = True  # ZeroMQ will not retry this socket: make a new one
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
        self.reason = ""

    def on_left(self) -> None:
        if self.joined:
            self.joined = False
            self.since = time.monotonic()
