"""The daemon-to-daemon mesh: one ROUTER to receive on, one DEALER per peer to send on.

Every message goes out on the sender's DEALER to the receiver's ROUTER, whose routing
id is the sender's node name, so the receiver always knows who spoke. Liveness is
the time since the last message from a node (heartbeats keep it fresh).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
import zmq
import zmq.asyncio

from weightwire.protocol.errors import PeerLostError, ProtocolError, TimeoutError_
from weightwire.protocol.frames import HARD_LIMIT_FACTOR, Codec
from weightwire.protocol.peer import PeerError, PeerMessage, PeerMsg

from .lograte import Throttled

log = structlog.get_logger("weightwire.daemon.peers")

Handler = Callable[[str, PeerMessage], Awaitable[None]]

COORDINATOR = "@coordinator"  # the mesh's name for the coordinator until it says its own


@dataclass
class Security:
    """ZeroMQ CURVE keys for peer sockets; None keys mean plaintext (explicitly insecure)."""

    public_key: bytes | None = None
    secret_key: bytes | None = None
    allowed: frozenset[bytes] = frozenset()
    coordinator_key: bytes | None = None

    @property
    def curve(self) -> bool:
        return self.secret_key is not None

    def server(self, sock: zmq.asyncio.Socket) -> None:
        if self.curve:
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key
            sock.curve_server = True

    def client(self, sock: zmq.asyncio.Socket, server_key: bytes | None) -> None:
        if self.curve:
            if not server_key:
                raise ProtocolError("peer advertised no CURVE key while CURVE is on")
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key
            sock.curve_serverkey = server_key


@dataclass
class PeerMesh:
    node: str
    ctx: zmq.asyncio.Context
    codec: Codec[PeerMessage]
    security: Security = field(default_factory=Security)
    endpoint: str = ""
    last_seen: dict[str, float] = field(default_factory=dict)
    _router: zmq.asyncio.Socket | None = None
    _dealers: dict[tuple[str, bytes | None], zmq.asyncio.Socket] = field(default_factory=dict)
    _endpoints: dict[str, tuple[str, bytes | None]] = field(default_factory=dict)
    _pending: dict[int, asyncio.Future[PeerMessage]] = field(default_factory=dict)
    _reqs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _bad: Throttled = field(default_factory=Throttled)  # one line per interval, with a count

    def bind(self, address: str, advertise_host: str) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_bytes * HARD_LIMIT_FACTOR)
        self.security.server(sock)
        sock.bind(address)
        real = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        port = real.rsplit(":", 1)[1]
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self.endpoint = f"tcp://{host}:{port}"
        self._router = sock
        return self.endpoint

    def know(self, node: str, endpoint: str, public_key: bytes | None = None) -> None:
        """Where `node` listens. Names sharing an endpoint share one connection."""
        old = self._endpoints.get(node)
        if old == (endpoint, public_key):
            return
        self._endpoints[node] = (endpoint, public_key)
        if old is not None and old not in self._endpoints.values():
            sock = self._dealers.pop(old, None)
            if sock is not None:
                sock.close(linger=0)

    def _dealer(self, node: str) -> zmq.asyncio.Socket:
        target = self._endpoints.get(node)
        if target is None:
            raise PeerLostError(f"no endpoint known for node {node}")
        sock = self._dealers.get(target)
        if sock is not None:
            return sock
        endpoint, key = target
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.node.encode())
        sock.setsockopt(zmq.SNDHWM, 10000)
        self.security.client(sock, key)
        sock.connect(endpoint)
        self._dealers[target] = sock
        return sock

    async def send(self, node: str, msg: PeerMsg) -> None:
        sock = self._dealer(node)
        try:
            await asyncio.wait_for(sock.send_multipart(self.codec.encode(msg)), 5.0)
        except TimeoutError:
            raise TimeoutError_(f"sending {type(msg).__name__} to {node} timed out") from None

    def send_soon(self, node: str, msg: PeerMsg) -> None:
        """Fire and forget (heartbeats, notices): a lost peer is noticed by liveness, not here."""
        try:
            self._dealer(node).send_multipart(self.codec.encode(msg), flags=zmq.NOBLOCK)
        except (zmq.Again, PeerLostError) as exc:
            log.debug("peer message dropped", peer=node, message=type(msg).__name__, error=str(exc))

    async def request(self, node: str, msg: PeerMsg, timeout_s: float) -> PeerMessage:
        """Send a message with a fresh `req` and wait for the message that answers it."""
        import msgspec

        req = next(self._reqs)
        fut: asyncio.Future[PeerMessage] = asyncio.get_running_loop().create_future()
        self._pending[req] = fut
        try:
            await self.send(node, msgspec.structs.replace(msg, req=req))
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TimeoutError_(
                f"{node} did not answer {type(msg).__name__} within {timeout_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(req, None)

    def resolve(self, req: int, msg: PeerMessage) -> bool:
        fut = self._pending.get(req)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    async def serve(self, handle: Handler) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart(copy=False)
            sender = bytes(frames[0].buffer).decode(errors="replace")
            self.last_seen[sender] = time.monotonic()
            try:
                msg, _ = self.codec.decode(frames[1:])
            except Exception as exc:  # nothing a peer sends may end this loop
                if not isinstance(exc, ProtocolError):
                    exc = ProtocolError(repr(exc))
                self._bad.emit(
                    log.warning,
                    "bad peer message",
                    peer=sender,
                    code=exc.code.value,
                    error=exc.message,
                )
                self.send_soon(sender, PeerError(code=exc.code.value, message=exc.message))
                continue
            try:
                await handle(sender, msg)
            except Exception:
                log.exception(
                    "peer message handler failed", peer=sender, message=type(msg).__name__
                )

    def alive(self, node: str, timeout_s: float) -> bool:
        seen = self.last_seen.get(node)
        return seen is not None and time.monotonic() - seen <= timeout_s

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self._router is not None:
            self._router.close(linger=0)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerLostError("daemon shutting down"))
