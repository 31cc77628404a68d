"""A daemon near its file descriptor limit, flooded with local connections.

libzmq aborts the process when its ipc listener's accept fails with EMFILE (it expects
that errno from its tcp listener, not there): a daemon with 100 descriptors to spare was
SIGABRTed by 1000 connections ("Too many open files (src/ipc_listener.cpp:297)"). Now the
daemon sets its socket's name aside before the last descriptors go (daemon/fdguard.py):
it lives, a version published meanwhile reaches the engine rank whose session was open
before the flood, bitwise; a rank that connects meanwhile hears `busy`; once the flood
lets go, the socket has its name back and a new job syncs bitwise. Real daemons (in
network namespaces as root), the limit lowered on the running daemon with prlimit, to
600 descriptors to spare: the guard keeps 272 of them free (with 50, a guard thread not
scheduled in time under load let libzmq accept past the limit and abort)."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, ProtocolError

from .conftest import FAST, NETNS, serve

SPARE = 600  # descriptors the engine host's daemon has left once its limit is lowered
FLOOD = 1000  # local connections opened at it at once


@pytest.fixture
def two() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra=FAST))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_local_connections_at_the_descriptor_limit_is_survived(
    two: LocalCluster,
) -> None:
    c = two
    host = c.daemons[1]
    w = torch.arange(1 << 14, dtype=torch.float32)
    dst = torch.zeros_like(w)
    eng = Engine(0, 1, socket=host.socket, job="before", timeout_s=30)
    tr = Trainer(0, 1, socket=c.daemons[0].socket, job="before", timeout_s=30)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, FLOOD + 1024)), hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, FLOOD + 64)
    flood: list[zmq.Socket[bytes]] = []
    try:
        eng.register({"w": dst})
        tr.register({"w": w})
        tr.publish(1)
        eng.wait(1)
        pid = host.proc.pid
        limit = fds(pid) + SPARE
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:{limit}"], check=True)
        for _ in range(FLOOD):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{host.socket}")
            flood.append(s)
        deadline = time.monotonic() + 10
        while not os.path.exists(host.socket + ".full"):
            assert host.proc.poll() is None, f"the daemon died: {host.proc.returncode}"
            assert time.monotonic() < deadline, "the socket was never set aside"
            time.sleep(0.05)
        time.sleep(1.0)  # the flood's reconnects keep trying meanwhile
        assert host.proc.poll() is None, f"the daemon died: {host.proc.returncode}"
        assert fds(pid) < limit
        with pytest.raises(ProtocolError) as busy:
            Engine(0, 1, socket=host.socket, job="during", timeout_s=5)
        assert busy.value.code is ErrorCode.BUSY and "descriptor" in busy.value.message
        w.mul_(3)
        tr.publish(2)  # the sessions open before the flood go on
        eng.wait(2)
        assert torch.equal(dst, w)
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.monotonic() + 10
        while not os.path.exists(host.socket):
            assert time.monotonic() < deadline, "the socket never got its name back"
            time.sleep(0.05)
        assert host.proc.poll() is None
        dst2 = torch.zeros_like(w)
        eng2 = Engine(0, 1, socket=host.socket, job="after", timeout_s=30)
        tr2 = Trainer(0, 1, socket=c.daemons[0].socket, job="after", timeout_s=30)
        try:
            eng2.register({"w": dst2})
            tr2.register({"w": w * 5})
            tr2.publish(1)
            eng2.wait(1)
            assert torch.equal(dst2, w * 5)
        finally:
            tr2.close()
            eng2.close()
        events = [e.get("event") for e in host.logs()]
        assert events.count("local socket paused: descriptors near the limit") >= 1, events
        assert "local socket listening again" in events
    finally:
        for s in flood:
            s.close()
        ctx.term()
        tr.close()
        eng.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
