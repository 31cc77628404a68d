"""The tcp data port under abuse (issue 14, item 4): connections that never say hello, too
many of them, too many from one node, and a listener out of descriptors. Real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.transport.tcp import TcpTransport, auth, handshake, wire
from weightwire.transport.tcp.data import DataHello, Refused

HERE = Path(__file__).parent


def closed_by_peer(s: socket.socket, timeout_s: float) -> bool:
    """Whether the far side closes `s` within the time (EOF or reset)."""
    s.settimeout(timeout_s)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


async def until(cond, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_silent_connections_are_closed_after_the_handshake_timeout() -> None:
    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1", handshake_timeout_s=0.5)
        await t.start(lambda imm, node: None)
        try:
            socks = [socket.create_connection(("127.0.0.1", t.port)) for _ in range(5)]
            # and one that says hello with a real ticket, reads its challenge, and never
            # proves it holds the ticket: not authenticated, so closed all the same
            request = auth.encode(auth.TicketRequest(mode=int(auth.Mode.AUTH)))
            ticket = auth.decode_reply(await t.on_signal("b", request))
            assert isinstance(ticket, auth.TicketGrant)
            hello = DataHello(
                protocol=PROTOCOL_VERSION, node="b", ticket=ticket.ticket, nonce=auth.nonce()
            )
            half = socket.create_connection(("127.0.0.1", t.port))
            half.sendall(wire.encode(hello))
            half.settimeout(5)
            kind, _ = wire.decode_prefix(await asyncio.to_thread(half.recv, 5, socket.MSG_WAITALL))
            assert kind == 5  # Challenge
            socks.append(half)
            assert await until(lambda: t.incoming() == 6, 5)
            closed = await asyncio.gather(*(asyncio.to_thread(closed_by_peer, s, 5) for s in socks))
            assert all(closed), closed
            assert await until(lambda: t.incoming() == 0, 5), t.incoming()
            for s in socks:
                s.close()
        finally:
            await t.close()

    uvloop.run(body())


def test_connections_without_hello_are_capped_the_oldest_closed_first() -> None:
    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1", max_unauthenticated=4)
        await t.start(lambda imm, node: None)
        try:
            socks = [socket.create_connection(("127.0.0.1", t.port)) for _ in range(12)]
            assert await until(lambda: t.stats()["connections_refused"] == 8, 5), t.stats()
            assert t.incoming() == 4
            closed = await asyncio.gather(
                *(asyncio.to_thread(closed_by_peer, s, 0.5) for s in socks)
            )
            # each new one took the place of the oldest waiting: the four newest are open
            # (refusing the new ones let a host holding four silent ones shut writers out)
            assert closed == [True] * 8 + [False] * 4, closed
            for s in socks:
                s.close()
            assert await until(lambda: t.incoming() == 0, 5), t.incoming()
        finally:
            await t.close()

    uvloop.run(body())


async def authenticated(t: TcpTransport, node: str) -> tuple[socket.socket, auth.Channel]:
    """A data connection to `t` that completes the handshake as `node`, with a ticket `t`
    issued to `node` the way the control channel asks for one."""
    loop = asyncio.get_running_loop()
    request = auth.encode(auth.TicketRequest(mode=int(auth.Mode.AUTH)))
    ticket = auth.decode_reply(await t.on_signal(node, request))
    assert isinstance(ticket, auth.TicketGrant)
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", t.port))
    channel = await handshake.connect(loop, s, node, t.node, ticket)
    assert channel is not None
    return s, channel


async def release(transports: list[TcpTransport], files: list[Any]) -> None:
    """Close the transports, then unlink and close the region files."""
    for tr in transports:
        await tr.close()
    for f in files:
        f.unlink()
        f.close()


def test_one_node_cannot_hold_more_than_its_share_of_connections() -> None:
    """The cap counts authenticated connections by the authenticated name; hellos that only
    claim the name (no ticket) are refused and never count toward it."""

    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1", max_streams_per_peer=3)
        await t.start(lambda imm, node: None)
        claim = wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="greedy"))
        try:
            claims = []
            for _ in range(3):  # a keyless host claiming the name takes none of its share
                c = socket.create_connection(("127.0.0.1", t.port))
                c.sendall(claim)
                claims.append(c)
            socks = [(await authenticated(t, "greedy"))[0] for _ in range(3)]
            assert await until(lambda: t.incoming() == 3, 5), t.incoming()
            extra, channel = await authenticated(t, "greedy")
            extra.setblocking(True)
            extra.settimeout(5)
            prefix = await asyncio.to_thread(extra.recv, 5, socket.MSG_WAITALL)
            kind, hlen = wire.decode_prefix(prefix)
            sealed = await asyncio.to_thread(extra.recv, hlen + auth.TAG, socket.MSG_WAITALL)
            msg = wire.decode_header(kind, channel.receive.header(prefix, sealed))
            assert isinstance(msg, Refused) and msg.code == "too_large", msg
            assert "greedy" in msg.message
            other, _ = await authenticated(t, "modest")  # another node still gets in
            assert await until(lambda: t.incoming() == 4, 5), t.incoming()
            for s in [*claims, *socks, extra, other]:
                s.close()
            assert await until(lambda: t.incoming() == 0, 5), t.incoming()
        finally:
            await t.close()

    uvloop.run(body())


EMFILE_SCRIPT = r"""
import asyncio, json, os, resource, sys, time
import structlog, uvloop
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.memory.hostmem import create_shared
from weightwire.transport.tcp import TcpTransport
from weightwire.protocol.regions import RegionDescriptor

logged = []

def keep(_logger, _method, event):
    logged.append(event)
    raise structlog.DropEvent

structlog.configure(processors=[keep])

def limit(kind):
    # descriptors ("fds": 8 more than in use) or tasks ("tasks": 2 more threads, a pids
    # cgroup as systemd's TasksMax makes) nearly exhausted; returns what lifts the limit
    if kind == "fds":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    root = sys.argv[3]
    cg = f"{root}/ww-tasks-{os.getpid()}"
    os.mkdir(cg)
    with open(f"{cg}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    with open(f"{cg}/pids.max", "w") as f:
        f.write(str(int(open(f"{cg}/pids.current").read()) + 2))

    def lift():
        with open(f"{cg}/pids.max", "w") as f:
            f.write("max")
        with open(f"{root}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(cg)

    return lift

async def main():
    t = TcpTransport("a", bind_host="127.0.0.1", max_unauthenticated=10_000)
    await t.start(lambda imm, node: got.append(imm))
    w = TcpTransport("b", bind_host="127.0.0.1")
    await w.start(lambda imm, node: None)
    f, g = create_shared(1 << 20, purpose="test"), create_shared(1 << 20, purpose="test")
    src = LocalRegion(id=1, kind="cpu", length=1 << 20, view=f.view, fd=f.fd)
    dst = LocalRegion(id=2, kind="cpu", length=1 << 20, view=g.view, fd=g.fd)
    src.view[:] = bytes(range(256)) * 4096
    desc = RegionDescriptor(id=2, node="a", kind="cpu", length=1 << 20, keys=t.register(dst))
    t.authorize(2, frozenset({"b"}))  # b writes here, with a ticket a issues to it

    async def signal(peer, payload):
        return await t.on_signal("b", payload)

    w.set_signal(signal)
    fds = len(os.listdir("/proc/self/fd"))
    restore = limit(sys.argv[2])
    print(json.dumps({"port": t.port}), flush=True)
    cpu0 = time.process_time()
    await asyncio.sleep(float(sys.argv[1]))  # the flood, from another process
    cpu = time.process_time() - cpu0
    restore()
    await asyncio.sleep(1.5)  # the listener's pause ends; the flood's sockets are gone
    left = {"incoming": t.incoming(), "fds_more": len(os.listdir("/proc/self/fd")) - fds}
    await w.connect("a", t.endpoints())
    await w.write(WriteRequest(src, 0, desc, 0, 1 << 20, 7))
    lines = [e for e in logged if e.get("event") == "tcp accept failed; pausing the listener"]
    print(json.dumps({
        "cpu_s": cpu, "accept_errors": t.stats()["accept_errors"], "log_lines": len(lines),
        "errnos": sorted({e["errno"] for e in lines}), "landed": bytes(dst.view) == bytes(src.view),
        "imms": got, **left,
    }), flush=True)
    await w.close()
    await t.close()

got = []
uvloop.run(main())
"""


def flooded(kind: str, *args: str, seconds: float = 4.0) -> dict[str, Any]:
    """EMFILE_SCRIPT's transport under limit `kind`, flooded with connections held open
    meanwhile; its report (it exited 0, so its transports closed, with nothing on stderr)."""
    with tempfile.TemporaryFile("w+") as stderr:  # not a pipe: a full one blocks the script
        proc = subprocess.Popen(
            [sys.executable, "-c", EMFILE_SCRIPT, str(seconds), kind, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(HERE.parent)},
        )
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        held = []
        deadline = time.monotonic() + seconds - 1
        while time.monotonic() < deadline and len(held) < 200:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
        time.sleep(max(0.0, deadline - time.monotonic()))
        for s in held:
            s.close()
        report: dict[str, Any] = json.loads(proc.stdout.readline())
        code = proc.wait(30)
        stderr.seek(0)
        err = stderr.read()
        assert code == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    print(report)
    return report


def test_out_of_descriptors_the_listener_backs_off_and_logs_once_per_interval() -> None:
    report = flooded("fds")
    assert report["accept_errors"] >= 1, report  # it did run out of descriptors
    assert report["errnos"] == ["EMFILE"], report
    # paused 50 ms doubling to 1 s: a handful of tries in 4 s, not a spin of thousands
    assert report["accept_errors"] <= 20, report
    assert report["log_lines"] == 1, report  # once per 10 s interval
    assert report["landed"] and report["imms"] == [7], report


PIDS = Path("/sys/fs/cgroup/pids")  # cgroup v1's pids controller (v2: the unified root)


@pytest.mark.skipif(
    not os.access(PIDS if PIDS.is_dir() else "/sys/fs/cgroup", os.W_OK),
    reason="no writable pids cgroup",
)
def test_out_of_threads_the_listener_backs_off_and_leaks_nothing() -> None:
    """A task limit (systemd's TasksMax) leaves no thread for new connections. Each accept
    raised 'can't start new thread' into the loop (a traceback each), the connection stayed
    counted with its descriptor open and nothing to end it, and closing the transport
    failed ('cannot join thread before it is started'). Now it is closed and the listener
    pauses as for EMFILE; once the limit is lifted nothing is left over, a write lands."""
    report = flooded("tasks", str(PIDS if PIDS.is_dir() else "/sys/fs/cgroup"))
    assert report["accept_errors"] >= 1, report  # it did run out of threads
    assert report["log_lines"] == 1 and report["accept_errors"] <= 20, report
    assert report["incoming"] == 0 and report["fds_more"] <= 0, report
    assert report["landed"] and report["imms"] == [7], report


def test_an_authenticated_peer_stalled_mid_write_is_closed_and_delivers_nothing() -> None:
    """A writer with a valid ticket and grant sends a write's header and half its payload,
    then stalls with its connection open (a hung peer, or one that means harm). The
    receiver closes it after stall_timeout_s; no immediate is delivered for the half write,
    the receive thread and descriptor are given back, and a whole write then lands."""
    from weightwire.memory.hostmem import create_shared
    from weightwire.protocol.regions import RegionDescriptor
    from weightwire.transport.base import LocalRegion, WriteRequest
    from weightwire.transport.tcp.data import Write

    n = 1 << 16

    async def body() -> None:
        imms: list[tuple[int, str]] = []
        t = TcpTransport("a", bind_host="127.0.0.1", stall_timeout_s=1.0)
        await t.start(lambda imm, node: imms.append((imm, node)))
        files = [create_shared(n, purpose="test") for _ in range(2)]
        w = TcpTransport("b", bind_host="127.0.0.1")
        try:
            src = LocalRegion(id=1, kind="cpu", length=n, view=files[0].view, fd=files[0].fd)
            dst = LocalRegion(id=2, kind="cpu", length=n, view=files[1].view, fd=files[1].fd)
            src.view[:] = bytes(range(256)) * (n // 256)
            keys = t.register(dst)
            t.authorize(2, frozenset({"b"}), "plan")
            assert keys.tcp is not None
            rkey = auth.plan_rkey(keys.tcp.rkey, "plan")
            s, channel = await authenticated(t, "b")
            s.setblocking(True)
            header = Write(seq=1, region=2, rkey=rkey, offset=0, length=n, imm=7, tag=7)
            s.sendall(wire.seal(wire.encode(header), channel.send))
            s.sendall(bytes(src.view[: n // 2]))  # half the payload, then nothing
            t0 = time.monotonic()
            assert await asyncio.to_thread(closed_by_peer, s, 10), "a stalled writer kept"
            assert time.monotonic() - t0 < 1.0 + 3, time.monotonic() - t0
            s.close()
            assert await until(lambda: t.incoming() == 0, 5), t.incoming()
            assert imms == [], imms  # the half write delivered no immediate
            await w.start(lambda imm, node: None)

            async def signal(peer: str, payload: bytes) -> bytes:
                return await t.on_signal("b", payload)

            w.set_signal(signal)
            desc = RegionDescriptor(id=2, node="a", kind="cpu", length=n, keys=keys)
            desc = msgspec.structs.replace(
                desc, keys=msgspec.structs.replace(keys, tcp=msgspec.structs.replace(
                    keys.tcp, rkey=rkey))
            )  # fmt: skip
            await w.connect("a", t.endpoints())
            await asyncio.wait_for(w.write(WriteRequest(src, 0, desc, 0, n, 9)), 10)
            assert bytes(dst.view) == bytes(src.view)
            assert await until(lambda: imms == [(9, "b")], 5), imms
        finally:
            await release([w, t], files)

    uvloop.run(body())


def test_a_peer_trickling_a_write_is_closed_while_another_writer_lands() -> None:
    """A writer with a valid ticket and grant sends a write's header, then its payload one
    byte every 0.4 s: never silent for stall_timeout_s, so closing only silent peers kept
    it (and its receive thread) for ever. It is closed once the frame is stall_timeout_s
    old and delivers no immediate; meanwhile another node's writes land bitwise."""
    from weightwire.memory.hostmem import create_shared
    from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey
    from weightwire.transport.base import LocalRegion, WriteRequest
    from weightwire.transport.tcp.data import Write

    n, stall_s = 1 << 16, 1.5

    def trickle(s: socket.socket) -> float:
        """One byte every 0.4 s until the receiver closes; how long that took."""
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 20:
                s.send(b"\x01")
                time.sleep(0.4)
        except OSError:
            pass
        return time.monotonic() - t0

    async def body() -> None:
        imms: list[tuple[int, str]] = []
        t = TcpTransport("a", bind_host="127.0.0.1", stall_timeout_s=stall_s)
        await t.start(lambda imm, node: imms.append((imm, node)))
        files = [create_shared(n, purpose="test") for _ in range(3)]
        w = TcpTransport("c", bind_host="127.0.0.1", streams=1)
        try:
            src, trickled, honest = (
                LocalRegion(id=i + 1, kind="cpu", length=n, view=f.view, fd=f.fd)
                for i, f in enumerate(files)
            )
            keys = {r.id: t.register(r) for r in (trickled, honest)}
            t.authorize(2, frozenset({"b"}), "plan")
            t.authorize(3, frozenset({"c"}), "plan")
            rkeys = {i: auth.plan_rkey(k.tcp.rkey, "plan") for i, k in keys.items() if k.tcp}
            s, channel = await authenticated(t, "b")
            s.setblocking(True)
            header = Write(seq=1, region=2, rkey=rkeys[2], offset=0, length=n, imm=7, tag=7)
            s.sendall(wire.seal(wire.encode(header), channel.send))
            held = asyncio.ensure_future(asyncio.to_thread(trickle, s))

            async def signal(peer: str, payload: bytes) -> bytes:
                return await t.on_signal("c", payload)

            await w.start(lambda imm, node: None)
            w.set_signal(signal)
            desc = RegionDescriptor(
                id=3, node="a", kind="cpu", length=n, keys=RegionKeys(tcp=TcpKey(rkey=rkeys[3]))
            )
            await w.connect("a", t.endpoints())
            landed = 0
            while not held.done():  # the other writer is served all along
                src.view[:] = bytes([landed % 251 + 1]) * n
                await asyncio.wait_for(w.write(WriteRequest(src, 0, desc, 0, n, 100)), 10)
                assert bytes(honest.view) == bytes(src.view)
                landed += 1
                await asyncio.sleep(0.2)
            held_s = held.result()
            s.close()
            assert held_s < stall_s + 3, f"a trickling writer was kept {held_s:.1f} s"
            assert landed >= 3, landed
            assert await until(lambda: len(imms) == landed, 5), imms
            assert all(imm == (100, "c") for imm in imms), imms  # none from the trickler
            assert await until(lambda: t.incoming() == 1, 5), t.incoming()  # c's stream only
        finally:
            await release([w, t], files)

    uvloop.run(body())


def test_a_host_sending_garbage_in_a_loop_gets_one_line_a_while() -> None:
    """A host that connects, sends garbage and closes, 300 times: every connection is
    refused and counted, and logged once per interval (a warning per connection let
    anyone who reaches the port flood the daemon's log: 833 lines in 3 s)."""
    from structlog.testing import capture_logs

    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1")
        await t.start(lambda imm, node: None)

        def garbage(times: int) -> None:
            for _ in range(times):
                with socket.create_connection(("127.0.0.1", t.port)) as s:
                    s.sendall(b"\x09" * 16)
                    closed_by_peer(s, 5)  # refused: the daemon closes it

        try:
            with capture_logs() as logs:
                await asyncio.to_thread(garbage, 300)
                assert await until(lambda: t.stats()["refused"] == 300, 5), t.stats()
            refusals = [e for e in logs if e["event"] == "tcp write refused; closing connection"]
            assert len(refusals) == 1, len(refusals)
            assert refusals[0]["code"] == "malformed", refusals
        finally:
            await t.close()

    uvloop.run(body())
