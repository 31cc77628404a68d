"""A node that cannot join says why, once per interval, and tells systemd READY only once
it has joined (STATUS says what it waits for)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from weightwire.client.status import fetch
from weightwire.daemon.security import keygen
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.frames import Codec
from weightwire.protocol.peer import Member, PeerError, PeerHello, PeerMessage

from .conftest import FAST, NETNS


class Sink:
    """A NOTIFY_SOCKET: the datagrams a daemon sends to systemd."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.seen: list[str] = []

    def drain(self, seconds: float) -> list[str]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.seen.append(self.sock.recv(4096).decode())
        return self.seen


@pytest.fixture
def untrusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """host0 coordinates; host1's key is not in its allow-list; host1 reports to a sink."""
    c = LocalCluster(hosts=2, use_netns=NETNS, extra=FAST)
    keygen(str(c.workdir / "keys" / "host1"), "host1")  # made, never copied to the trusted dir
    c.keys("host0")
    if c.use_netns:
        c.net = netns.Hosts(2)
    sink = Sink(tmp_path / "notify.sock")
    try:
        c.start_daemon(0, coordinator=True)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
        c.start_daemon(1)
        monkeypatch.delenv("NOTIFY_SOCKET")
        yield c, sink
    finally:
        assert c.stop() == [0, 0], f"logs in {c.workdir}"
        sink.sock.close()


def wait_log(c: LocalCluster, node: str, event: str, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [e for e in c.daemon(node).logs() if e.get("event") == event]
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"no {event!r} from {node} in {timeout} s: {c.daemon(node).logs()}")


def test_untrusted_node_says_why_once_per_interval_and_is_not_ready(untrusted: tuple) -> None:
    c, sink = untrusted
    first = wait_log(c, "host1", "cannot join", timeout=15)[0]
    assert "refused this node's CURVE key" in first["reason"], first
    assert "curve_allowed_keys_dir" in first["reason"]
    seen = sink.drain(4)
    assert not any("READY=1" in m for m in seen), seen
    assert any("STATUS=waiting to join the coordinator" in m for m in seen), seen
    lines = [e for e in c.daemon("host1").logs() if e.get("event") == "cannot join"]
    assert len(lines) == 1, lines  # once per 10 s, not once per attempt


def test_protocol_skew_is_answered_with_the_reason() -> None:
    c = LocalCluster(hosts=1, extra=FAST)  # loopback: this process talks to it directly
    c.keys("skewed")  # a trusted peer that speaks another protocol version
    c.start()
    public, secret = zmq.auth.load_certificate(
        str(c.workdir / "keys" / "skewed" / "skewed.key_secret")
    )
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"skewed")
    dealer.curve_publickey, dealer.curve_secretkey = public, secret
    dealer.curve_serverkey = c.coordinator_key().encode()
    # daemons answer on the sender's own listening socket
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_publickey, router.curve_secretkey = public, secret
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        hello = PeerHello(
            protocol=PROTOCOL_VERSION + 1,
            member=Member(
                node="skewed",
                endpoint=f"tcp://127.0.0.1:{port}",
                incarnation="x",
                public_key=public.decode(),
            ),
        )
        codec = Codec(PeerMessage)
        dealer.connect(c.daemons[0].endpoint)
        dealer.send_multipart(codec.encode(hello))
        assert router.poll(10_000), "no answer to a hello of another protocol version"
        reply, _ = codec.decode(router.recv_multipart()[1:])
        assert isinstance(reply, PeerError) and reply.code == "protocol", reply
        assert f"protocol {PROTOCOL_VERSION + 1}" in reply.message
        assert "same weightwire version" in reply.message
    finally:
        dealer.close()
        router.close()
        assert c.stop() == [0]


def test_sighup_reloads_the_allow_list_and_the_node_joins(untrusted: tuple) -> None:
    """The untrusted node's key is added to the coordinator's allow-list directory; after a
    SIGHUP (no restart) it joins, and only then tells systemd READY."""
    import shutil
    import signal

    c, sink = untrusted
    wait_log(c, "host1", "cannot join", timeout=15)
    assert "host1" not in (fetch(c.daemons[0].socket)["coordination"] or {})["members"]
    public = c.workdir / "keys" / "host1" / "host1.key"
    shutil.copy(public, c.workdir / "keys" / "public" / "host1.key")
    coordinator = c.daemons[0].proc
    pid = coordinator.pid
    coordinator.send_signal(signal.SIGHUP)
    reloaded = wait_log(c, "host0", "keys reloaded", timeout=10)[0]
    assert reloaded["added"] == 1 and reloaded["removed"] == 0
    try:
        c.wait_joined(timeout_s=15)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}; logs in {c.workdir}") from None
    assert coordinator.poll() is None and coordinator.pid == pid  # the same process
    seen = sink.drain(2)
    ready = [m for m in seen if "READY=1" in m]
    assert ready, seen
    assert f"MAINPID={c.daemons[1].proc.pid}" in ready[0] and "joined host0" in ready[0]


def test_sighup_with_a_half_written_key_file_keeps_the_old_keys_and_says_which(
    untrusted: tuple,
) -> None:
    """The untrusted node's key is copied into the allow-list directory in two steps (a
    half-written file, as a slow copy leaves it, then the whole one), with a SIGHUP after
    each. The first reload fails with one line naming the file, the old keys stay in use
    and the daemon serves on; after the second the node joins. The bad file's ValueError
    escaped the reload, as asyncio's 'Exception in callback' traceback on stderr."""
    import signal

    c, _ = untrusted
    wait_log(c, "host1", "cannot join", timeout=15)
    public = c.workdir / "keys" / "host1" / "host1.key"
    trusted = c.workdir / "keys" / "public" / "host1.key"
    trusted.write_bytes(public.read_bytes()[:40])  # cut before the public key line
    coordinator = c.daemons[0].proc
    coordinator.send_signal(signal.SIGHUP)
    failed = wait_log(c, "host0", "SIGHUP: keys not reloaded; the old ones stay in use", 10)
    assert str(trusted) in failed[0]["error"], failed
    assert "host1" not in (fetch(c.daemons[0].socket)["coordination"] or {})["members"]
    trusted.write_bytes(public.read_bytes())
    coordinator.send_signal(signal.SIGHUP)
    reloaded = wait_log(c, "host0", "keys reloaded", timeout=10)[0]
    assert reloaded["added"] == 1 and reloaded["removed"] == 0, reloaded
    try:
        c.wait_joined(timeout_s=15)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}; logs in {c.workdir}") from None
    assert coordinator.poll() is None


def test_a_daemon_started_with_a_key_file_holding_no_key_names_it(tmp_path: Path) -> None:
    """A *.key file in curve_allowed_keys_dir that holds no public key: the daemon refuses
    to start with one 'daemon failed' line naming the file (it died with a traceback)."""
    import json
    import subprocess
    import sys

    keygen(str(tmp_path), "me")
    (tmp_path / "peers").mkdir()
    bad = tmp_path / "peers" / "half.key"
    bad.write_text("#   ****  Generated on 2026-11-24 by pyzmq  ****\n")
    proc = subprocess.run(
        [sys.executable, "-m", "weightwire.daemon", "--node", "x", "--is-coordinator",
         "--local-socket", str(tmp_path / "x.sock"), "--peer-bind", "tcp://127.0.0.1:0",
         "--curve-secret-key-file", str(tmp_path / "me.key_secret"),
         "--curve-allowed-keys-dir", str(tmp_path / "peers")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() + proc.stderr.splitlines()
             if x.startswith("{")]  # fmt: skip
    failed = [e for e in lines if e.get("event") == "daemon failed"]
    assert failed and failed[0]["code"] == "invalid", lines
    assert str(bad) in failed[0]["error"], failed


def test_a_key_taken_off_the_allow_list_loses_its_membership_without_a_restart() -> None:
    """host1's key is removed from the coordinator's allow-list directory and the
    coordinator SIGHUPed. ZAP checks only handshakes: host1's connection, made before,
    went on carrying its messages, and it stayed a member (with its plans and data
    connections) until a restart. Now its messages are dropped, and it is lost like a
    silent node within heartbeat_timeout_s."""
    import signal

    c = LocalCluster(hosts=2, use_netns=NETNS, extra=FAST)
    c.start()
    try:
        c.wait_joined()
        members = (fetch(c.daemons[0].socket)["coordination"] or {})["members"]
        assert "host1" in members, members
        (c.workdir / "keys" / "public" / "host1.key").unlink()
        coordinator = c.daemons[0].proc
        coordinator.send_signal(signal.SIGHUP)
        reloaded = wait_log(c, "host0", "keys reloaded", timeout=10)[0]
        assert reloaded["removed"] == 1, reloaded
        deadline = time.monotonic() + float(FAST["heartbeat-timeout-s"]) + 10
        while "host1" in (fetch(c.daemons[0].socket)["coordination"] or {})["members"]:
            assert time.monotonic() < deadline, f"host1 still a member; logs in {c.workdir}"
            time.sleep(0.2)
        dropped = wait_log(c, "host0", "peer message from a key no longer trusted; dropped", 10)
        assert dropped[0]["peer"] == "host1", dropped
        assert coordinator.poll() is None
    finally:
        assert c.stop() == [0, 0], f"logs in {c.workdir}"
