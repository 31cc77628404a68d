"""The tcp transport: one-sided writes over plain TCP, several streams per peer.

Every region gets a random 64-bit key when it is registered (tcp's rkey), and under
each plan answers to a key derived from it and the plan (`auth.plan_rkey`). A write
must come from a node `authorize` named as a writer of the region (regions.py), name the
region and its key, carry the tag (immediate) of a version this node has not failed
(`set_admission`), and stay inside the region, or it is refused, logged, and its
connection closed.
Connections are authenticated (and optionally encrypted) as auth.py describes, with
tickets that the destination issues over the control channel (`on_signal`). GPU regions,
on either end, go through at most `bounce_bytes` of pinned memory per stream (bounce.py).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import structlog

from weightwire.protocol.errors import (
    PeerLostError,
    RegionError,
)
from weightwire.protocol.regions import (
    RegionDescriptor,
    RegionKeys,
    TcpEndpoint,
    TcpKey,
    TransportEndpoints,
)
from weightwire.transport.base import (
    Admit,
    ImmHandler,
    LocalRegion,
    Prepared,
    Signal,
    Transport,
    WriteRequest,
    check_write,
    post_each,
)
from weightwire.transport.tcp.data import (
    Write,
)

from . import auth, dial, handshake, wire
from .admission import Admission, Backoff
from .bounce import DEFAULT_CAP, Bounce, Pinned
from .incoming import IncomingStream
from .regions import RegionTable
from .sink import StreamSink
from .streams import OutgoingStream, Pending, tune

log = structlog.get_logger("weightwire.transport.tcp")

FENCE_JOIN_S = 5.0  # how long a fence waits for the receive threads it stopped


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        node: str,
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        advertise_host: str | None = None,
        streams: int = 4,
        stall_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        handshake_timeout_s: float = 10.0,
        max_unauthenticated: int = 64,
        max_streams_per_peer: int = 64,
        security: str | auth.Mode = auth.Mode.AUTH,
        bounce_bytes: int = DEFAULT_CAP,
    ) -> None:
        self.node = node
        self.mode = auth.Mode.parse(security)
        self._tickets = auth.Tickets()
        self._signal: Signal | None = None
        self._bind = (bind_host, port)
        self._advertise_host = advertise_host
        self.streams = streams
        self.stall_timeout_s = stall_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.bounce_bytes = bounce_bytes
        self._pinned = Pinned()  # what the streams' bounce buffers hold
        self._table = RegionTable()
        self._peers: dict[str, list[OutgoingStream]] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._incoming = Admission(max_unauthenticated, max_streams_per_peer)
        self._backoff = Backoff()
        self._paused = False  # the listener, after a failed accept
        self._admit: Admit | None = None
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_imm: ImmHandler | None = None
        self._seq = itertools.count(1)
        self._counter_lock = threading.Lock()
        self._stats = {"bytes_sent": 0, "bytes_received": 0, "writes": 0, "refused": 0}

    # --- lifecycle -----------------------------------------------------------

    async def start(self, on_imm: ImmHandler) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_imm = on_imm
        family = socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._bind)
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock
        self._loop.add_reader(sock.fileno(), self._accept)
        log.debug("tcp transport listening", endpoint=self.endpoints().tcp)

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return int(self._listener.getsockname()[1])

    def endpoints(self) -> TransportEndpoints:
        host = self._advertise_host or self._bind[0]
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return TransportEndpoints(tcp=TcpEndpoint(host=host, port=self.port, streams=self.streams))

    def can_reach(self, endpoints: TransportEndpoints) -> bool:
        return endpoints.tcp is not None

    def accepts(self, src: LocalRegion, dst: RegionDescriptor) -> bool:
        return dst.keys.tcp is not None

    async def close(self) -> None:
        if self._loop is not None and self._listener is not None:
            if not self._paused:
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        outgoing = [s for streams in self._peers.values() for s in streams]
        self._peers.clear()
        for s in outgoing:
            s.close("transport closed")
        incoming = self._incoming.take_all()
        for r in incoming:
            r.close()

        def join_all() -> None:
            deadline = time.monotonic() + 5.0
            for out in outgoing:
                out.join(max(0.0, deadline - time.monotonic()))
            for inc in incoming:
                inc.join(max(0.0, deadline - time.monotonic()))

        await asyncio.to_thread(join_all)

    # --- regions -------------------------------------------------------------

    def register(self, region: LocalRegion) -> RegionKeys:
        if region.view is None and region.kind != "gpu":
            raise RegionError(f"tcp cannot reach region {region.id}: no host view, not a GPU")
        kept = region.extra.get("tcp_rkey")  # a region remapped keeps its key (regions.py)
        rkey = kept if isinstance(kept, int) else secrets.randbits(64)
        self._table.add(region, rkey)
        return RegionKeys(tcp=TcpKey(rkey=rkey))

    def deregister(self, region_id: int) -> None:
        self._table.remove(region_id)

    def drained(self, region_id: int, timeout_s: float) -> bool:
        """A receive stream copying a write into a GPU region through its bounce counts it
        from the write's lookup to its last copy (`RegionTable.writing`)."""
        return self._table.drained(region_id, timeout_s)

    def authorize(self, region_id: int, writers: frozenset[str], scope: str = "") -> None:
        self._table.grant(region_id, writers, scope)

    # --- authentication ------------------------------------------------------

    def set_signal(self, signal: Signal) -> None:
        self._signal = signal

    async def on_signal(self, node: str, payload: bytes) -> bytes:
        """A writer asks for a ticket; `node` is the name the control channel authenticated."""
        return handshake.grant(self._tickets, self.mode, node, payload)

    # --- receive side --------------------------------------------------------

    def set_admission(self, admit: Admit) -> None:
        self._admit = admit

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        try:
            conn, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # EMFILE and the like: pause, rather than spin on it
            self._pause(exc)
            return
        address = f"{addr[0]}:{addr[1]}"
        number = self._incoming.number(address)
        if number is None:
            conn.close()
            return
        tune(conn, self.stall_timeout_s)
        sink = StreamSink(self._table, self._admit, self._new_bounce)
        stream = IncomingStream(
            sock=conn,
            address=address,
            loop=self._loop,
            machine=wire.ReceiveMachine(
                sink, handshake.Acceptor(self.node, self.mode, self._tickets)
            ),
            on_imm=self._deliver_imm,
            stall_timeout_s=self.stall_timeout_s,
            on_received=self._count_received,
            on_refused=self._count_refused,
            handshake_timeout_s=self.handshake_timeout_s,
            gate=self._incoming,
            number=number,
            release=sink.close,
        )
        self._incoming.add(stream)
        try:
            stream.start()
        except RuntimeError as exc:  # no thread for it (a task limit, or memory): as EMFILE
            # It stayed counted with its socket open and no thread to end it (descriptors
            # leaked, close() failed joining it) and each accept logged a traceback.
            self._incoming.ended(stream)
            conn.close()
            self._pause(exc)
            return
        self._backoff.ok()  # only now: accepts that work while threads fail pause all the same

    def _new_bounce(self) -> Bounce:
        return Bounce(self.bounce_bytes, self.stall_timeout_s, self._pinned)

    def _pause(self, exc: Exception) -> None:
        """Stop accepting for a while after `exc` (backing off), with one line a while."""
        assert self._listener is not None and self._loop is not None
        self._loop.remove_reader(self._listener.fileno())
        self._paused = True
        self._loop.call_later(self._backoff.failed(exc), self._resume_accepting)

    def _resume_accepting(self) -> None:
        if self._listener is not None and self._loop is not None and self._paused:
            self._paused = False
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def incoming(self) -> int:
        """Receive streams open now (connections accepted and not yet ended)."""
        return len(self._incoming)

    async def fence(self, node: str, reason: str) -> None:
        doomed = self._incoming.fence(node)
        for stream in doomed:
            stream.close()

        def join_all() -> list[IncomingStream]:
            deadline = time.monotonic() + FENCE_JOIN_S
            return [s for s in doomed if not s.join(max(0.0, deadline - time.monotonic()))]

        stuck = await asyncio.to_thread(join_all) if doomed else []
        if stuck:
            log.error("tcp fence: receive threads still running", peer=node, streams=len(stuck))
        log.info("tcp fenced", peer=node, streams=len(doomed), reason=reason)

    def _deliver_imm(self, imm: int, peer: str) -> None:
        if self._on_imm is not None:
            self._on_imm(imm, peer)

    def _count_received(self, n: int) -> None:
        with self._counter_lock:
            self._stats["bytes_received"] += n

    def _count_refused(self) -> None:
        with self._counter_lock:
            self._stats["refused"] += 1

    def _count_sent(self, n: int) -> None:
        with self._counter_lock:
            self._stats["bytes_sent"] += n
            self._stats["writes"] += 1

    # --- send side -----------------------------------------------------------

    async def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        ep = endpoints.tcp
        if ep is None:
            raise PeerLostError(f"node {node} has no tcp endpoint")
        lock = self._connecting.setdefault(node, asyncio.Lock())
        async with lock:
            current = self._peers.get(node)
            if current and all(s.dead is None for s in current):
                return
            if current:
                for s in current:
                    s.close("reconnecting")
            streams = []
            try:
                ticket = await dial.ticket(
                    self.node, node, self.mode, self.on_signal, self._signal, self.connect_timeout_s
                )
                for _ in range(max(1, min(self.streams, ep.streams))):
                    stream = await dial.open_stream(
                        self._loop, self.node, node, ep, ticket,
                        self.connect_timeout_s, self.stall_timeout_s, self._count_sent,
                        self.bounce_bytes, self._pinned,
                    )  # fmt: skip
                    streams.append(stream)
            except BaseException:
                for s in streams:
                    s.close("connect failed")
                raise
            self._peers[node] = streams
            log.debug("tcp connected", peer=node, streams=len(streams))

    async def disconnect(self, node: str, reason: str) -> None:
        self._tickets.revoke(node)
        for s in self._peers.pop(node, []):
            s.fail(PeerLostError(f"{node}: {reason}"))

    def prepare(self, requests: Sequence[WriteRequest]) -> Prepared:
        """Nothing to resolve up front: each post checks its writes."""
        return Prepared(requests)

    async def post(
        self, prepared: Prepared, imms: Sequence[int | None]
    ) -> list[BaseException | None]:
        return await post_each(self._write_one, prepared, imms)

    async def _write_one(self, r: WriteRequest, imm: int | None) -> None:
        """A strided write goes as one frame per block on one connection, the immediate on
        the last: the receiver handles a connection's frames in order."""
        check_write(r)
        src, dst, length, count = r.src, r.dst, r.length, r.count
        if src.view is None and src.fd is None and src.kind != "gpu":
            raise RegionError(f"tcp cannot read region {src.id} ({src.kind} memory)")
        if dst.keys.tcp is None:
            raise RegionError(f"region {dst.id} of node {dst.node} has no tcp key")
        streams = self._peers.get(dst.node)
        if not streams:
            raise PeerLostError(f"not connected to node {dst.node}")
        live = [s for s in streams if s.dead is None]
        if not live:
            raise PeerLostError(f"every connection to {dst.node} is down: {streams[0].dead}")
        stream = min(live, key=lambda s: s.outstanding_bytes)
        assert self._loop is not None
        futures: list[asyncio.Future[None]] = []
        for i in range(count):
            seq = next(self._seq)
            fut: asyncio.Future[None] = self._loop.create_future()
            last = i == count - 1
            header = wire.encode(
                Write(
                    seq=seq,
                    region=dst.id,
                    rkey=dst.keys.tcp.rkey,
                    offset=r.dst_offset + i * r.dst_stride,
                    length=length,
                    imm=-1 if imm is None or not last else imm,
                    tag=-1 if imm is None else imm,
                )
            )
            stream.submit(Pending(seq, fut, header, src, r.src_offset + i * r.src_stride, length))
            futures.append(fut)
        await (futures[0] if count == 1 else asyncio.gather(*futures))

    def stats(self) -> dict[str, int]:
        with self._counter_lock:
            out = dict(self._stats)
        out["connections_refused"] = self._incoming.refused
        out["accept_errors"] = self._backoff.failures
        out["bounce_bytes"] = self._pinned.now  # pinned for GPU regions, every stream
        out["bounce_largest_bytes"] = self._pinned.largest  # one stream's most
        return out
