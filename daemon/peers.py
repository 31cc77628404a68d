"""The daemon-to-daemon mesh: one ROUTER to receive on, one DEALER per peer to send on.

Every message goes out on the sender's DEALER to the receiver's ROUTER. The routing id
(NAME/NONCE) says which node the sender claims to be; the CURVE key its connection
authenticated with says who it is, and `Names` decides whether the two agree before the
message is acted on (see names.py). Liveness is the time since the last accepted message
from a node (heartbeats keep it fresh).

Connections are kept honest by ZeroMQ itself: ZMTP heartbeats close a connection that
went silent (a link that went down leaves TCP retransmitting with exponential backoff for
minutes), and reconnection is retried at a bounded interval, so a node is back within
about a second of its link returning, however long it was away.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
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
from .names import Names, RefusalLog, claimed_name, routing_id

log = structlog.get_logger("weightwire.daemon.peers")

Handler = Callable[[str, PeerMessage, bytes | None], Awaitable[None]]  # name, message, key

RECONNECT_IVL_MS = 100  # first retry after a connection is lost
RECONNECT_IVL_MAX_MS = 500  # retries back off up to this, never further
CONNECT_TIMEOUT_MS = 1000  # a connect attempt into a dead link is given up after this
HANDSHAKE_S = 5.0  # a connection that has not finished its ZMTP/CURVE handshake is closed

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
    heartbeat_interval_s: float = 0.5  # ZMTP PINGs on every connection
    heartbeat_timeout_s: float = 2.5  # a connection silent this long after a PING is closed
    endpoint: str = ""
    names: Names = field(init=False)
    refusals: RefusalLog = field(default_factory=RefusalLog)
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    last_seen: dict[str, float] = field(default_factory=dict)
    _router: zmq.asyncio.Socket | None = None
    _dealers: dict[tuple[str, bytes | None], zmq.asyncio.Socket] = field(default_factory=dict)
    # Each dealer's synchronous shadow (see `send_soon`), and how many awaited sends wait
    # for room on it (`send`): while any does, `send_soon` queues behind them in order.
    _shadows: dict[zmq.asyncio.Socket, zmq.Socket[bytes]] = field(default_factory=dict)
    _queued: dict[zmq.asyncio.Socket, int] = field(default_factory=dict)
    _endpoints: dict[str, tuple[str, bytes | None]] = field(default_factory=dict)
    _pending: dict[int, tuple[str, asyncio.Future[PeerMessage]]] = field(default_factory=dict)
    _reqs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _bad: Throttled = field(default_factory=Throttled)  # one line per interval, with a count

    def __post_init__(self) -> None:
        self.names = Names(curve=self.security.curve, coordinator_key=self.security.coordinator_key)

    def _keepalive(self, sock: zmq.asyncio.Socket) -> None:
        # libzmq's default handshake time is 30 s: a TCP connect and silence held one of
        # the daemon's descriptors that long, no key needed
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        ivl = max(100, int(self.heartbeat_interval_s * 1000))
        timeout = max(ivl, int(self.heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        sock.setsockopt(zmq.HEARTBEAT_TTL, timeout)  # the other end closes it too

    def bind(self, address: str, advertise_host: str) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_bytes * HARD_LIMIT_FACTOR)
        self._keepalive(sock)
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
            self._close_dealer(old)

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
        sock.setsockopt(zmq.IDENTITY, routing_id(self.node, self.nonce))
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        self._keepalive(sock)
        self.security.client(sock, key)
        sock.connect(endpoint)
        self._dealers[target] = sock
        self._shadows[sock] = zmq.Socket.shadow(sock.underlying)
        return sock

    def _close_dealer(self, target: tuple[str, bytes | None]) -> None:
        sock = self._dealers.pop(target, None)
        if sock is not None:
            self._shadows.pop(sock, None)
            sock.close(linger=0)

    def socket_to(self, node: str) -> zmq.asyncio.Socket:
        """The (lazily connected) socket that carries messages to `node`."""
        return self._dealer(node)

    def reconnect(self, node: str) -> None:
        """Close the socket to `node`; the next message makes a new one. ZeroMQ does not
        retry a connection whose CURVE handshake the peer refused: after the peer starts
        trusting this node's key (SIGHUP), only a new socket gets in."""
        target = self._endpoints.get(node)
        if target is not None:
            self._close_dealer(target)

    async def send(self, node: str, msg: PeerMsg) -> None:
        sock = self._dealer(node)
        sent = asyncio.ensure_future(sock.send_multipart(self.codec.encode(msg)))  # a Future
        if sent.done():  # sent at once: the usual case
            sent.result()
            return
        self._queued[sock] = self._queued.get(sock, 0) + 1  # waits for room: see send_soon
        try:
            await asyncio.wait_for(sent, 5.0)
        except TimeoutError:
            raise TimeoutError_(f"sending {type(msg).__name__} to {node} timed out") from None
        finally:
            left = self._queued.pop(sock, 1) - 1
            if left > 0:
                self._queued[sock] = left

    def send_soon(self, node: str, msg: PeerMsg) -> None:
        """Fire and forget (heartbeats, notices): a lost peer is noticed by liveness, not here.

        Sent through the dealer's synchronous shadow (the same libzmq socket), without the
        zmq.asyncio future, its result and its done callback per message (the VersionStart
        announce of every version goes here). Safe because this event loop's thread is the
        only user of the socket (no concurrent use), no one receives on a dealer (so no
        recv future waits on the edge-triggered descriptor this send may consume), and
        zmq.asyncio's own NOBLOCK send is this very call on its shadow; only while an
        awaited `send` waits for room does the message go through zmq.asyncio, which queues
        it behind that one, in order. A full queue (EAGAIN) falls back to the async send:
        that reports it as today (dropped, logged) or queues it behind a send waiting.
        """
        try:
            sock = self._dealer(node)
            frames = self.codec.encode(msg)
            if not self._queued.get(sock):
                try:
                    self._shadows[sock].send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            sent = sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except (zmq.Again, PeerLostError) as exc:
            log.debug("peer message dropped", peer=node, message=type(msg).__name__, error=str(exc))
            return
        if isinstance(sent, asyncio.Future):  # zmq.asyncio reports a full queue (Again) here
            sent.add_done_callback(_dropped)

    async def request(self, node: str, msg: PeerMsg, timeout_s: float) -> PeerMessage:
        """Send a message with a fresh `req` and wait for the message that answers it."""
        import msgspec

        req = next(self._reqs)
        fut: asyncio.Future[PeerMessage] = asyncio.get_running_loop().create_future()
        self._pending[req] = (node, fut)
        try:
            await self.send(node, msgspec.structs.replace(msg, req=req))
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TimeoutError_(
                f"{node} did not answer {type(msg).__name__} within {timeout_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(req, None)

    def resolve(self, sender: str, req: int, msg: PeerMessage) -> bool:
        """Answer request `req` with `msg`, if `sender` is the node it was asked of."""
        node, fut = self._pending.get(req, ("", None))
        if fut is None or fut.done() or node != sender:
            return False
        fut.set_result(msg)
        return True

    async def serve(self, handle: Handler) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart(copy=False)
            sender = claimed_name(bytes(frames[0].buffer))
            key = _authenticated_key(frames[0]) if self.security.curve else None
            if key is not None and key not in self.security.allowed:
                # a key taken off the allow-list (SIGHUP) on a connection it opened before:
                # ZAP checks only handshakes, so its messages kept coming (and it kept its
                # membership, plans and data connections) until a restart. Unheard, it is
                # lost after heartbeat_timeout_s like a silent node: fenced, tickets revoked.
                self._bad.emit(log.warning, "peer message from a key no longer trusted; dropped",
                               peer=sender, key=key.decode(errors="replace"))  # fmt: skip
                continue
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
                if self.names.speaks_as(sender, key):  # never answer a forger's victim
                    self.send_soon(sender, PeerError(code=exc.code.value, message=exc.message))
                continue
            refusal = self.names.refusal(sender, key, msg)
            if refusal is not None:
                self.refusals.refused(sender, key, type(msg).__name__, refusal)
                continue
            self.last_seen[sender] = time.monotonic()
            try:
                await handle(sender, msg, key)
            except Exception:
                log.exception(
                    "peer message handler failed", peer=sender, message=type(msg).__name__
                )

    def public_key(self, node: str) -> bytes | None:
        """The z85 CURVE key bound to `node` (None: not a member known here, or no CURVE)."""
        return self.names.key_of(node)

    def alive(self, node: str, timeout_s: float) -> bool:
        seen = self.last_seen.get(node)
        return seen is not None and time.monotonic() - seen <= timeout_s

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._shadows.clear()
        if self._router is not None:
            self._router.close(linger=0)
        for _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerLostError("daemon shutting down"))


def _authenticated_key(frame: zmq.Frame) -> bytes | None:
    """The z85 CURVE public key the sender's connection authenticated with (the ZAP user id)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user.encode() if isinstance(user, str) and user else None


def _dropped(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("peer message dropped", error=str(fut.exception()))
