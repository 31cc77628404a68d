"""Connections to a daemon's peer port (ZeroMQ, CURVE) that never finish the handshake: a
TCP connect and nothing more, or the first bytes of a ZMTP greeting and then silence.
libzmq's default gives a handshake 30 s, so whoever can reach the port held a descriptor of
the daemon's for 30 s per connection (no key needed), and the descriptors it can be made to
hold at once grew with the connect rate. The daemon now closes them after HANDSHAKE_S;
a real daemon, its descriptors back where they were, and it serves on."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from weightwire.client.status import fetch
from weightwire.daemon.peers import HANDSHAKE_S
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, serve

SILENT = 50


@pytest.fixture(scope="module")
def one() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=1, use_netns=False, extra=FAST))


def closed_within(sock: socket.socket, deadline: float) -> float | None:
    """Seconds until the daemon closed `sock` (None: still open at `deadline`)."""
    t0 = time.monotonic()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return time.monotonic() - t0
        except TimeoutError:
            return None
        except OSError:  # reset
            return time.monotonic() - t0
    return None


def test_silent_connections_to_the_peer_port_are_closed_after_the_handshake_time(
    one: LocalCluster,
) -> None:
    d = one.daemons[0]
    host, port = d.endpoint.removeprefix("tcp://").rsplit(":", 1)
    before = int(fetch(d.socket)["open_fds"])
    socks = [socket.create_connection((host, int(port))) for _ in range(SILENT)]
    greeting = socket.create_connection((host, int(port)))
    greeting.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")  # a ZMTP signature, then silence
    socks.append(greeting)
    time.sleep(0.5)
    held = int(fetch(d.socket)["open_fds"])
    assert held >= before + SILENT, (before, held)  # the daemon holds them now
    deadline = time.monotonic() + HANDSHAKE_S + 5
    waited = [closed_within(s, deadline) for s in socks]
    for s in socks:
        s.close()
    assert all(w is not None for w in waited), f"{waited.count(None)} still open"
    print(f"\n{len(socks)} silent connections closed after {max(w or 0 for w in waited):.1f} s")
    t = time.monotonic() + 5
    while int(fetch(d.socket)["open_fds"]) > before + 2:
        assert time.monotonic() < t, (before, fetch(d.socket)["open_fds"])
        time.sleep(0.1)
