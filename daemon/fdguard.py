"""Keeps the local socket from taking the daemon's last file descriptors.

libzmq aborts the whole process when its ipc listener's accept fails with EMFILE: its
src/ipc_listener.cpp asserts that errno is one it expects, and on POSIX EMFILE is not
among them (its tcp listener's list has it). A daemon at its descriptor limit died at the
next rank that connected ("Too many open files (src/ipc_listener.cpp:297)", SIGABRT): 100
connections opened at a daemon with 20 descriptors to spare were enough.

So the daemon raises its soft limit to the hard one at start (as systemd's unit does with
LimitNOFILE), and `DescriptorGuard`, a thread of its own, watches the local ROUTER: every
connection it accepts (a ZeroMQ monitor event naming the descriptor, the lowest one free)
and, four times a second, the lowest free descriptor (where the next accept would land).
When fewer than `headroom` are left above it, it renames the socket file aside
(NAME.full), so that no new connection reaches the listener, and renames it back once
enough are free (`thresholds`). Sessions already open go on; a rank that connects
meanwhile hears `busy` (the name set aside says why), and a ZeroMQ reconnect is retried
until the name is back. Unbinding would not do: libzmq closes every connection a listener
accepted with it. A thread, not the event loop: a burst of connections is accepted in
libzmq's own thread within milliseconds, and the rename (a syscall, no ZeroMQ call) is
made as soon as the monitor says.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import threading
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger("weightwire.daemon.fdguard")

CHECK_S = 0.25  # descriptors counted at least this often
BACKLOG = 16  # connections the kernel queues for the listener (ZMQ_BACKLOG; more retry)


def raise_soft_limit() -> tuple[int, int]:
    """The descriptor limit (soft, hard), the soft one raised to the hard one if it can be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


def limit() -> int:
    """The soft descriptor limit now (another process may change it: prlimit)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def in_use() -> int | None:
    """The lowest free descriptor: every one below it is in use, and it is the one the
    next accepted connection gets (the kernel gives the lowest free one). One open and
    close, whatever the number open; None when none is free."""
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    os.close(fd)
    return fd


BURST = 256  # connections libzmq may accept before the guard's thread runs (a loaded host)


def headroom(lim: int, base: int) -> int:
    """Descriptors kept free under `lim`: the connections the kernel may have queued when
    the listener's name goes and a burst accepted before the guard hears of it (`BURST`:
    with 50 kept free, a flood of 1000 on a loaded 2-core host got past a guard that was
    not scheduled in time, and libzmq aborted the daemon), a small share of a large limit;
    at most half of what the daemon had to spare (`base` in use when it started), so that
    a small limit still takes connections."""
    return max(1, min(max(BACKLOG + BURST, min(4096, lim // 8)), (lim - base) // 2))


def thresholds(lim: int, base: int) -> tuple[int, int]:
    """(pause at, resume below): descriptors in use where the socket's name is taken away,
    and under which it is given back (a headroom lower, at most half way down to `base`)."""
    pause = lim - headroom(lim, base)
    return pause, pause - min(headroom(lim, base), max(1, (pause - base) // 2))


class DescriptorGuard:
    """Takes the local socket's name away near the descriptor limit, and gives it back
    once descriptors are free again. `watch(monitor)` runs it (on its own thread)."""

    def __init__(
        self,
        path: str,
        *,
        limit_of: Callable[[], int] = limit,
        used: Callable[[], int | None] = in_use,
        say: Callable[..., None] | None = None,
    ) -> None:
        self.path = path
        self.aside = path + ".full"
        self._limit = limit_of
        self._used = used
        self._say = say or (lambda method, event, **kw: method(event, **kw))
        self.base = used() or 0  # in use (below the lowest free) as the daemon starts
        self.paused = False
        self.pauses = 0
        self.stop = threading.Event()

    def check(self, used: int | None = None) -> None:
        """Pause or resume by `used`: the lowest free descriptor (found now when not given;
        a hole below the ones in use lets connections in again, and the next accept that
        lands past the mark pauses again)."""
        lim = self._limit()
        pause, resume = thresholds(lim, self.base)
        if used is None:
            counted = self._used()
            used = lim if counted is None else counted  # none free: full
        if not self.paused and used >= pause:
            try:
                os.rename(self.path, self.aside)
            except OSError as exc:
                self._say(log.error, "could not take the local socket's name", error=str(exc))
                return
            self.paused, self.pauses = True, self.pauses + 1
            self._say(
                log.warning,
                "local socket paused: descriptors near the limit",
                in_use=used,
                limit=lim,
                resumes_below=resume,
            )
        elif self.paused and used < resume:
            try:
                os.rename(self.aside, self.path)
            except OSError as exc:
                self._say(log.error, "could not give the local socket its name", error=str(exc))
                return
            self.paused = False
            self._say(log.info, "local socket listening again", in_use=used, limit=lim)

    def watch(self, monitor: zmq.Socket[bytes]) -> None:
        """Until `stop` is set: `monitor` is the ROUTER's monitor socket (EVENT_ACCEPTED),
        used by this thread only."""
        try:
            while not self.stop.is_set():
                if monitor.poll(int(CHECK_S * 1000)):
                    event = parse_monitor_message(monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_ACCEPTED and not self.paused:
                        # the descriptor accepted was the lowest free one: all below are used
                        self.check(int(event["value"]) + 1)
                        continue
                self.check()
        except zmq.ZMQError as exc:  # the context ended under it: the daemon is stopping
            if not self.stop.is_set():
                self._say(log.error, "descriptor guard stopped", error=str(exc))

    def close(self) -> None:
        """Give the socket its name back (the daemon unlinks it as it stops)."""
        if self.paused:
            with contextlib.suppress(OSError):
                os.rename(self.aside, self.path)
            self.paused = False


class GuardThread:
    """A `DescriptorGuard` of a ROUTER bound at `path`, on a thread of its own from now
    until `close` (its lines logged by the event loop running now)."""

    def __init__(self, sock: zmq.asyncio.Socket, path: str) -> None:
        loop = asyncio.get_running_loop()
        endpoint = f"inproc://weightwire-accepted-{id(self)}"
        sock.monitor(endpoint, zmq.EVENT_ACCEPTED)

        def say(method: Callable[..., None], event: str, **fields: Any) -> None:
            loop.call_soon_threadsafe(functools.partial(method, event, **fields))

        self.guard = DescriptorGuard(path, say=say)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(sock.context.underlying)

        def run() -> None:
            monitor = ctx.socket(zmq.PAIR)
            try:
                monitor.connect(endpoint)
                self.guard.watch(monitor)
            finally:
                monitor.close(linger=0)

        self._thread = threading.Thread(target=run, name="fdguard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.guard.stop.set()
        self._thread.join(2 * CHECK_S + 1.0)  # it polls every CHECK_S
        self.guard.close()
