"""What the daemon records about finished work: a narrow seam, and its Prometheus side.

The publisher and the completions call a `Recorder` once per finished thing (a bucket
landed, a rank's version finished), never per tensor or per write. `Recorders` fans one
call out to several (the Prometheus endpoint, the canonical version log line).

prometheus-client is the `[metrics]` extra: imported only when `metrics_bind` is set.
"""

from __future__ import annotations

import contextlib
import io
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from weightwire.protocol.errors import ErrorCode, WeightwireError

PREFIX = "weightwire_"
HTTP_CONNECTIONS = 8  # scrapes served at once; more are closed unanswered
HTTP_TIMEOUT_S = 5.0  # a request not whole this long after the connection is closed
EVICT_WAIT_S = 1.0  # how long a new connection waits for the slot of one it evicted

# Seconds: a bucket's writes land in ~1 ms (same host) to seconds (a slow link).
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_BYTES = tuple(float(1 << s) for s in range(20, 42, 2))  # 1 MiB .. 2 TiB
_RATE = tuple(x * 1e9 for x in (0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400))


class Recorder(Protocol):
    def bucket_landed(self, job: str, seconds: float) -> None:
        """A bucket's writes all landed, `seconds` after it was posted."""

    def rank_version(
        self,
        job: str,
        role: str,
        rank: int,
        version: int,
        nbytes: int,
        seconds: float,
        peers: Mapping[str, int],
        code: str | None,
        timeline: Mapping[str, float] | None = None,
    ) -> None:
        """A rank of this node finished a version: `role` trainer (published) or engine
        (received); `peers` the other nodes with the bytes sent to each (trainer) or the
        sources (engine, bytes 0 where unknown); `code` None when it succeeded."""


class Recorders:
    """Fans each call out to every recorder in it."""

    def __init__(self, *recorders: Recorder) -> None:
        self.recorders = list(recorders)

    def bucket_landed(self, job: str, seconds: float) -> None:
        for r in self.recorders:
            r.bucket_landed(job, seconds)

    def rank_version(
        self,
        job: str,
        role: str,
        rank: int,
        version: int,
        nbytes: int,
        seconds: float,
        peers: Mapping[str, int],
        code: str | None,
        timeline: Mapping[str, float] | None = None,
    ) -> None:
        for r in self.recorders:
            r.rank_version(job, role, rank, version, nbytes, seconds, peers, code, timeline)


class MetricsUnavailable(WeightwireError):
    code = ErrorCode.INVALID


class Prometheus:
    """The daemon's metrics on a registry of its own, served over HTTP at `bind`."""

    def __init__(
        self, node: str, live_peers: Callable[[], int], regions: Callable[[], int]
    ) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise MetricsUnavailable(
                "metrics_bind is set, but prometheus-client is not installed: "
                "pip install 'weightwire[metrics]' (or unset metrics_bind)"
            ) from None
        self._pc = pc
        self.registry = pc.CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        self.version_seconds = pc.Histogram(
            p + "version_seconds",
            "Time a rank of this node took for one version (trainer: begin to every write "
            "landed; engine: first write to complete)",
            ["job", "role"],
            buckets=_SECONDS,
            registry=r,
        )
        self.version_bytes = pc.Histogram(
            p + "version_bytes",
            "Bytes one rank of this node sent (trainer) or received (engine) in one version",
            ["job", "role"],
            buckets=_BYTES,
            registry=r,
        )
        self.peer_throughput = pc.Histogram(
            p + "peer_throughput_bytes_per_second",
            "Bytes a trainer rank wrote to one peer node in a version, over the version's time",
            ["job", "peer"],
            buckets=_RATE,
            registry=r,
        )
        self.peer_bytes = pc.Counter(
            p + "peer_sent_bytes",
            "Bytes written by this node's trainer ranks to each peer node",
            ["job", "peer"],
            registry=r,
        )
        self.bucket_seconds = pc.Histogram(
            p + "bucket_post_seconds",
            "Time from a bucket being posted to all its writes having landed",
            ["job"],
            buckets=_SECONDS,
            registry=r,
        )
        self.versions = pc.Counter(
            p + "versions",
            "Versions finished by this node's ranks, by outcome",
            ["job", "role", "outcome"],
            registry=r,
        )
        self.failures = pc.Counter(
            p + "failures",
            "Failed versions of this node's ranks, by error code",
            ["job", "role", "code"],
            registry=r,
        )
        live = pc.Gauge(p + "live_peers", "Peer daemons this node hears from", registry=r)
        live.set_function(lambda: float(live_peers()))
        regs = pc.Gauge(p + "regions", "Memory regions registered on this node", registry=r)
        regs.set_function(lambda: float(regions()))
        info = pc.Info(p + "daemon", "This daemon", registry=r)
        import weightwire

        info.info({"node": node, "version": weightwire.__version__})
        self._server: Any = None

    def serve(self, bind: str) -> tuple[str, int]:
        """Start the HTTP endpoint (a thread of prometheus-client's); the bound address."""
        host, _, port = bind.rpartition(":")
        if not host or not port.isdigit():
            raise MetricsUnavailable(f"metrics_bind {bind!r} is not HOST:PORT")
        try:
            server = _http_server(
                host.strip("[]"), int(port), self._pc.make_wsgi_app(self.registry)
            )
        except OSError as exc:
            raise MetricsUnavailable(f"metrics_bind {bind}: {exc}") from None
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        self._server = server
        return str(server.server_address[0]), int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
                self._server.server_close()
            self._server = None

    def bucket_landed(self, job: str, seconds: float) -> None:
        self.bucket_seconds.labels(job).observe(seconds)

    def rank_version(
        self,
        job: str,
        role: str,
        rank: int,
        version: int,
        nbytes: int,
        seconds: float,
        peers: Mapping[str, int],
        code: str | None,
        timeline: Mapping[str, float] | None = None,
    ) -> None:
        self.versions.labels(job, role, "ok" if code is None else "failed").inc()
        if code is not None:
            self.failures.labels(job, role, code).inc()
            return
        self.version_seconds.labels(job, role).observe(seconds)
        self.version_bytes.labels(job, role).observe(nbytes)
        if role == "trainer":
            for peer, n in peers.items():
                self.peer_bytes.labels(job, peer).inc(n)
                if seconds > 0 and n:
                    self.peer_throughput.labels(job, peer).observe(n / seconds)


class _Deadline(io.RawIOBase):
    """A connection's bytes, read until a deadline: the whole request must come within
    HTTP_TIMEOUT_S, not merely a byte that often (one byte a second kept a slot for ever)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # a request half sent holds its thread this long at most
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(
            _Deadline(self.connection, time.monotonic() + HTTP_TIMEOUT_S)
        )

    def parse_request(self) -> bool:
        whole = bool(super().parse_request())  # the request line's rest, and the headers
        self.server.done_reading(self.connection)  # the request is in: not evictable
        self.connection.settimeout(HTTP_TIMEOUT_S)  # for the answer
        return whole

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """prometheus-client's server (a thread per connection) with the connections it serves
    at once capped, and each one's silence bounded: stalled clients (a request line half
    sent) held a thread each for ever."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog (5 by default: clients beyond it wait seconds)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(HTTP_CONNECTIONS)
        # connections still sending their request, by when they were accepted: when every
        # slot is taken the oldest of them makes room (8 clients trickling requests shut
        # every scraper out, each new one closed unanswered)
        self._reading: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                oldest = min(self._reading, key=self._reading.__getitem__, default=None)
                self._reading.pop(oldest, None)  # type: ignore[arg-type]
            if oldest is not None:
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            if oldest is None or not self._slots.acquire(timeout=EVICT_WAIT_S):
                self.shutdown_request(request)
                return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.done_reading(request)
            self._slots.release()
            raise

    def done_reading(self, request: socket.socket) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.done_reading(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is no error of the daemon's (socketserver
        printed a traceback to stderr for each)."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def _http_server(host: str, port: int, app: Any) -> _Server:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(_Server):
        address_family = family

    server = Server((host, port), _Handler)
    server.set_app(app)
    return server
