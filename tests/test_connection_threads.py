"""`DaemonConnection` from several threads at once against a real daemon: requests are
sent from the callers' threads (the socket owned by a lock) while the connection's loop
thread reads replies and sends its own pings, so a lost wake-up (ZeroMQ's edge-triggered
descriptor consumed by a send) or a crossed reply would show here as a timeout or a
wrong answer."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from weightwire.client.connection import DaemonConnection
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import TimeoutError_
from weightwire.protocol.local import Hello, Ping, Pong, Welcome

from .conftest import FAST, serve


@pytest.fixture(scope="module")
def one() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=1, insecure=True, extra=FAST))


def _hello(conn: DaemonConnection, rank: int) -> str:
    hello = Hello(protocol=PROTOCOL_VERSION, role="engine", rank=rank, world_size=8, job="thr")
    reply = conn.request(hello)
    assert isinstance(reply, Welcome)
    return reply.session


def test_requests_from_many_threads_each_get_their_own_reply(one: LocalCluster) -> None:
    notes: list[object] = []
    with DaemonConnection(
        one.daemons[0].socket, on_notify=notes.append, ping_interval_s=0.005
    ) as conn:
        session = _hello(conn, 0)
        errors: list[BaseException] = []
        counts = [0] * 4

        def work(i: int) -> None:
            try:
                for _ in range(150):
                    reply = conn.request(Ping(), timeout_s=10)
                    assert isinstance(reply, Pong) and session.endswith(f":{reply.session}"), reply
                    counts[i] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert counts == [150] * 4
        assert not notes, notes  # every reply went to its waiter, none astray
        assert not conn.lost


def test_a_silent_daemon_times_the_request_out_and_the_connection_recovers(
    one: LocalCluster,
) -> None:
    pid = one.daemons[0].proc.pid
    with DaemonConnection(one.daemons[0].socket) as conn:
        _hello(conn, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(TimeoutError_) as e:
                conn.request(Ping(), timeout_s=0.5)
            assert "Ping" in e.value.message
            assert time.monotonic() - t < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert isinstance(conn.request(Ping(), timeout_s=10), Pong)


@pytest.mark.parametrize("inline_fails", [False, True])
def test_trainer_notifications_are_taken_on_the_connections_thread(
    one: LocalCluster, inline_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's notifications (landings, its version's result) are taken on the
    connection's own thread as they are read, not handed to the delivery thread; one whose
    inline handling raises goes to the delivery thread instead, and the publish still
    returns, bitwise."""
    import torch

    from weightwire.client import Engine, Trainer

    inline: list[str] = []
    delivered: list[str] = []
    take, deliver = Trainer._on_notify_inline, Trainer._on_notify

    def taken(self, msg):  # type: ignore[no-untyped-def]
        inline.append(threading.current_thread().name)
        if inline_fails:
            raise RuntimeError("inline handling failed")
        return take(self, msg)

    def handed(self, msg):  # type: ignore[no-untyped-def]
        delivered.append(threading.current_thread().name)
        deliver(self, msg)

    monkeypatch.setattr(Trainer, "_on_notify_inline", taken)
    monkeypatch.setattr(Trainer, "_on_notify", handed)
    sock = one.daemons[0].socket
    job = f"inline{int(inline_fails)}"
    w = torch.arange(256 * 64, dtype=torch.float32).view(256, 64)
    got = {"w": torch.zeros_like(w)}
    with Engine(0, 1, socket=sock, job=job, timeout_s=30) as eng:
        eng.register(got)
        with Trainer(0, 1, socket=sock, job=job, timeout_s=30) as tr:
            tr.register({"w": w})
            tr.prepare()
            for version in range(2):
                w.add_(1)
                tr.publish(version)
                eng.wait(version)
                assert torch.equal(got["w"], w)
    assert inline and set(inline) == {"ww-conn"}, inline
    if inline_fails:
        assert delivered and set(delivered) == {"ww-notify"}, delivered
    else:
        assert not delivered, delivered
