"""The local socket: the ranks of this host talk to the daemon here.

A ROUTER on an ipc path. Each connection is one session, which owns what it
registers; a session whose rank stops pinging is released with all of it. Every request gets
a reply, an `Error` when anything was wrong; nothing a rank sends stops the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
import zmq
import zmq.asyncio

from weightwire.memory.fdpass import FdPassError, Inbox
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, ProtocolError, WeightwireError
from weightwire.protocol.frames import HARD_LIMIT_FACTOR, Codec, request_id
from weightwire.protocol.local import (
    AbortVersion,
    Applied,
    BeginVersion,
    BucketReady,
    DeclareDestinations,
    DeclareSources,
    Error,
    GetPlan,
    Goodbye,
    Hello,
    LocalMessage,
    LocalMsg,
    Ok,
    Ping,
    Pong,
    RegisterRegion,
    RemapRegion,
    StatusReply,
    StatusRequest,
    TrailersReady,
    WaitVersion,
    Welcome,
)

from . import fdguard
from .localsocket import bind, gone
from .lograte import Throttled
from .packgate import features as FEATURES
from .pending import Pending
from .rankrequests import Identity, Requests
from .sessions import Session, check_hello

log = structlog.get_logger("weightwire.daemon.local")


class LocalServer:
    """The local socket and its sessions (implements `RankLink`). `serve(requests)` answers
    what the ranks ask; the sessions table is shared read-only with those that list ranks."""

    def __init__(
        self,
        path: str,
        mode: int,
        codec: Codec[LocalMessage],
        identity: Identity,
        sessions: dict[bytes, Session],
        status: Callable[[], dict[str, Any]],
        cluster_status: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.path = path
        self.mode = mode
        self.codec = codec
        self.identity = identity
        self.sessions = sessions
        self._status = status
        self._cluster = cluster_status
        self._requests: Requests | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._guard: fdguard.GuardThread | None = None
        self.pending = Pending()  # requests answered later, per connection
        self._start_post = False  # a BucketReady found its rank idle: yield after it
        self._bad = Throttled()  # a rank can send garbage in a loop: one line per interval
        self.inbox: Inbox | None = None  # file descriptors from ranks (VMM GPU memory)
        self._inbox_loop: asyncio.AbstractEventLoop | None = None  # drains it (serve)

    def bind(self, ctx: zmq.asyncio.Context) -> None:
        self._sock = bind(ctx, self.path, self.mode, self.codec.max_bytes * HARD_LIMIT_FACTOR)
        # no new connection near the descriptor limit, where libzmq's accept would abort
        # the daemon; sessions already open go on (fdguard.py)
        self._guard = fdguard.GuardThread(self._sock, self.path)
        try:
            self.inbox = Inbox(self.path + ".fds", self.mode)
        except OSError as exc:  # e.g. a path too long for a socket: VMM memory is refused
            log.warning("no fd socket: VMM GPU memory cannot be registered", error=str(exc))

    def claim_fds(self, token: bytes) -> list[int]:
        """The file descriptors a rank passed under `token` (memory.fdpass)."""
        if self.inbox is None:
            raise FdPassError(f"this daemon has no fd socket next to {self.path}")
        return self.inbox.claim(token)

    def send(self, identity: bytes, msg: LocalMsg) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *self.codec.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not reach a rank", message=type(msg).__name__, error=str(exc))

    def push(self, job: str, role: str, rank: int, msg: LocalMsg) -> None:
        """A notification to every session of (job, role, rank)."""
        for s in list(self.sessions.values()):
            if s.job == job and s.role == role and s.rank == rank:
                self.send(s.identity, msg)

    async def serve(self, requests: Requests) -> None:
        assert self._sock is not None
        self._requests = requests
        # The same socket without asyncio's future per message (pyzmq's shadow): what is
        # queued already is read with it, one call a message, until nothing is left; only
        # then does the loop wait on the socket again.
        now: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        if self.inbox is not None:  # batches taken as they come (fdpass.py says why)
            self._inbox_loop = asyncio.get_running_loop()
            self._inbox_loop.add_reader(self.inbox.fileno(), self.inbox.drain)
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            while True:
                self._handle(frames)
                if self._start_post:
                    # Let that bucket's post start (its copies issued) before the next
                    # queued message is read, or a burst of BucketReady would hold back the
                    # first bucket's copies until every one was read. Only when nothing of
                    # the rank's was being posted: otherwise the transport is busy anyway,
                    # and reading the burst first posts it in fewer, larger steps.
                    self._start_post = False
                    await asyncio.sleep(0)
                try:
                    frames = now.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """One message of a rank: decoded, dispatched, any error answered."""
        identity = bytes(frames[0].buffer)
        session = self.sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        try:
            msg, _ = self.codec.decode(frames[1:])
        except ProtocolError as exc:
            self._bad.emit(log.warning, "bad local message", code=exc.code.value, error=exc.message)
            req = request_id(frames[1:])
            self.send(identity, Error(req=req, code=exc.code.value, message=exc.message))
            return
        except Exception as exc:  # nothing a rank sends may end this loop
            log.exception("local message could not be decoded")
            self.send(identity, Error(code=ErrorCode.MALFORMED.value, message=repr(exc)))
            return
        try:
            if isinstance(msg, BucketReady):  # the hot path: its own log context (rank,
                self._dispatch(identity, msg)  # version), none bound per message here
            else:
                ctx = (
                    {"role": session.role, "rank": session.rank, "job": session.job}
                    if session
                    else {}
                )
                with structlog.contextvars.bound_contextvars(**ctx):
                    self._dispatch(identity, msg)
        except WeightwireError as exc:
            self._error(identity, msg.req, exc)
        except Exception as exc:  # a bug here must not take the daemon down
            log.exception("local request failed", message=type(msg).__name__)
            self._error(identity, msg.req, WeightwireError(f"internal error: {exc!r}"))

    def _error(self, identity: bytes, req: int, exc: WeightwireError) -> None:
        self.send(identity, Error(req=req, code=exc.code.value, message=exc.message))

    def _spawn(
        self,
        identity: bytes,
        req: int,
        work: Coroutine[Any, Any, LocalMsg | None],
        *,
        only_waits: bool = False,
    ) -> None:
        try:
            self.pending.check(identity)
        except ProtocolError:
            work.close()
            raise

        async def run() -> None:
            try:
                reply = await work
            except WeightwireError as exc:
                self._error(identity, req, exc)
            except Exception as exc:
                log.exception("local request failed")
                self._error(identity, req, WeightwireError(f"internal error: {exc!r}"))
            else:
                if reply is not None:
                    self.send(identity, reply)

        self.pending.start(identity, run(), only_waits=only_waits)

    def _session(self, identity: bytes, msg: LocalMsg) -> Session:
        session = self.sessions.get(identity)
        if session is None:
            raise ProtocolError(
                f"{type(msg).__name__} before hello: say hello first", code=ErrorCode.NO_SESSION
            )
        return session

    def _dispatch(self, identity: bytes, msg: LocalMessage) -> None:
        d = self._requests
        assert d is not None
        if isinstance(msg, Hello):
            self._hello(identity, msg)
            return
        session = self._session(identity, msg)
        match msg:
            case RegisterRegion():
                alive = functools.partial(self._alive, session)
                self._spawn(identity, msg.req, d.register(session, msg, alive))
            case RemapRegion():
                self._spawn(identity, msg.req, d.remap(session, msg))
            case DeclareSources(tensors=tensors):
                d.declare_sources(session, msg)
                self.send(identity, Ok(req=msg.req, detail=f"{len(tensors)} tensors"))
            case DeclareDestinations(tensors=tensors):
                d.declare_destinations(session, msg)
                self.send(identity, Ok(req=msg.req, detail=f"{len(tensors)} tensors"))
            case GetPlan(timeout_s=timeout_s):
                plan = d.plan_for(session, msg.req, timeout_s, msg.after_plan)
                self._spawn(identity, msg.req, plan, only_waits=True)
            case BeginVersion(version=version, plan_hash=plan_hash, staging_buckets=slots):
                fence = (msg.fence_offset, msg.fence_base, msg.gate_offset)
                args = (session, msg.req, version, plan_hash, slots, msg.slot_events, fence)
                answer = functools.partial(self.send, identity)
                if not d.begin_version_now(*args, answer=answer):  # no task hop unless
                    self._spawn(identity, msg.req, d.begin_version(*args))  # writes in flight
            case BucketReady():
                self._start_post = d.bucket_ready(session, msg)
            case TrailersReady():
                d.trailers_ready(session, msg)
            case Applied():
                d.applied(session, msg)
            case AbortVersion():
                d.abort_version(session, msg)
                self.send(identity, Ok(req=msg.req))
            case WaitVersion(version=version, timeout_s=timeout_s):
                wait = d.wait_version(session, msg.req, version, timeout_s)
                self._spawn(identity, msg.req, wait, only_waits=True)
            case Goodbye():
                self.close_session(identity)
            case Ping():
                self.send(identity, Pong(req=msg.req, session=session.id))
            case StatusRequest(cluster=True):
                self._spawn(identity, msg.req, self._cluster_status(msg.req), only_waits=True)
            case StatusRequest():
                body = {**self._status(), "requests_waiting": self.pending.count()}
                self.send(identity, StatusReply(req=msg.req, body=body))
            case _:
                raise ProtocolError(
                    f"{type(msg).__name__} is not a request a rank can send", code=ErrorCode.INVALID
                )

    async def _cluster_status(self, req: int) -> StatusReply:
        return StatusReply(req=req, body=await self._cluster())

    def _alive(self, session: Session) -> bool:
        return self.sessions.get(session.identity) is session

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.role != "admin":
            for s in list(self.sessions.values()):
                same = (s.job, s.role, s.rank) == (hello.job, hello.role, hello.rank)
                if same and s.identity != identity and self._gone(s.identity):
                    # its process died (a rank restarted at once): released now, not after
                    # session_timeout_s of silence
                    log.info("rank restarted; releasing its old session", pid=s.hello.pid)
                    self.close_session(s.identity)
        check_hello(identity, hello, self.sessions)
        session = Session(identity=identity, hello=hello)
        self.sessions[identity] = session
        (log.debug if hello.role == "admin" else log.info)(  # `weightwire status`: no chatter
            "rank connected", role=hello.role, rank=hello.rank, job=hello.job, pid=hello.pid
        )
        self.send(
            identity,
            Welcome(
                req=hello.req,
                protocol=PROTOCOL_VERSION,
                node=self.identity.node,
                session=self.identity.incarnation + ":" + session.id,
                daemon_version=self.identity.version,
                region_dir=self.identity.region_dir,
                max_message_bytes=self.codec.max_bytes,
                fd_socket=self.inbox.path if self.inbox is not None else "",
                features=FEATURES(),
            ),
        )

    def _gone(self, identity: bytes) -> bool:
        assert self._sock is not None
        return gone(self._sock, identity)

    def expire(self, timeout_s: float) -> None:
        """Release sessions whose rank has been silent (no ping) for `timeout_s`."""
        if self._requests is None:
            return
        now = time.monotonic()
        for identity, session in list(self.sessions.items()):
            if now - session.last_seen > timeout_s:
                del self.sessions[identity]
                self.pending.end(identity)
                log.warning(
                    "rank gone; releasing what it registered",
                    role=session.role,
                    rank=session.rank,
                    job=session.job,
                    pid=session.hello.pid,
                    silent_s=round(now - session.last_seen, 2),
                )
                self._requests.session_gone(session)

    def close_session(self, identity: bytes) -> None:
        session = self.sessions.pop(identity, None)
        self.pending.end(identity)
        if session is not None:
            (log.debug if session.role == "admin" else log.info)(
                "rank left", role=session.role, rank=session.rank, job=session.job
            )
            if self._requests is not None:
                self._requests.session_gone(session)

    def close(self) -> None:
        self.pending.cancel_all()
        if self._guard is not None:
            self._guard.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self.inbox is not None:
            loop = self._inbox_loop
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self.inbox.fileno())
            self.inbox.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
