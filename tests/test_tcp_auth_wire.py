"""Authenticated tcp data connections, without sockets: the handshake, sealed frames, and
what a forger, a replayer, a tamperer or an unplanned insider gets (nothing lands)."""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, ProtocolError
from weightwire.transport.base import LocalRegion
from weightwire.transport.tcp import auth, handshake, wire
from weightwire.transport.tcp.data import DataHello, Proof, Write
from weightwire.transport.tcp.regions import RegionTable
from weightwire.transport.tcp.sink import StreamSink

MiB = 1 << 20
SIZE = 3 * MiB + 100
RKEY = 42


class Reader:
    """A receive machine of node "engine" over one region, and its ticket office."""

    def __init__(self, mode: auth.Mode, writers: frozenset[str] = frozenset({"trainer"})) -> None:
        self.mem = bytearray(SIZE)
        self.table = RegionTable(grant_wait_s=0)
        self.table.add(LocalRegion(id=1, kind="cpu", length=SIZE, view=memoryview(self.mem)), RKEY)
        self.table.grant(1, writers, scope="plan-a")
        self.tickets = auth.Tickets()
        self.mode = mode
        self.m = wire.ReceiveMachine(self.table, handshake.Acceptor("engine", mode, self.tickets))

    def feed(self, data: bytes, step: int = 65536) -> list[object]:
        events = []
        while data:
            buf = self.m.buffer()
            n = min(step, len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            ev = self.m.received(n)
            if ev is not None:
                events.append(ev)
        return events


def connect(r: Reader, node: str = "trainer") -> auth.Channel:
    """The writer's half of the handshake against `r`; returns the writer's channel."""
    t = r.tickets.issue(node, r.mode)
    mine = auth.nonce()
    hello = DataHello(protocol=PROTOCOL_VERSION, node=node, ticket=t.id, nonce=mine)
    (reply,) = r.feed(wire.encode(hello))
    assert isinstance(reply, wire.Reply)
    challenge = wire.decode_header(reply.data[0], reply.data[wire.PREFIX.size :])
    keys = auth.derive(t.id, t.secret, node, "engine", mine, challenge.nonce, r.mode)
    assert auth.same(challenge.proof, keys.reader_proof)
    (ok,) = r.feed(wire.encode(Proof(proof=keys.writer_proof)))
    assert isinstance(ok, wire.HelloReceived) and r.m.peer == node
    return auth.channel(keys, r.mode, node, writer=True)


def sealed(ch: auth.Channel, write: Write, payload: bytes) -> bytes:
    out = [wire.seal(wire.encode(write), ch.send)]
    scratch = memoryview(bytearray(auth.RECORD + auth.TAG))
    for i in range(0, len(payload), auth.RECORD):
        rec = payload[i : i + auth.RECORD]
        if ch.send.encrypts:
            out.append(bytes(ch.send.encrypt_record(rec, scratch)))
        else:
            out += [rec, ch.send.record_tag(rec)]
    return b"".join(out)


def write(length: int, offset: int = 0, imm: int = 7, seq: int = 1, rkey: int = -1) -> Write:
    rkey = auth.plan_rkey(RKEY, "plan-a") if rkey < 0 else rkey
    return Write(seq=seq, region=1, rkey=rkey, offset=offset, length=length, imm=imm)


MODES = [auth.Mode.AUTH, auth.Mode.ENCRYPT]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", [1 << 10, 1 << 20])
def test_sealed_writes_land_bitwise(mode: auth.Mode, step: int) -> None:
    r = Reader(mode)
    ch = connect(r)
    data = os.urandom(2 * MiB + 7)
    events = r.feed(
        sealed(ch, write(len(data), offset=5), data) + sealed(ch, write(0, seq=2), b""), step
    )
    assert [type(e) for e in events] == [wire.Landed, wire.Landed]
    assert bytes(r.mem[5 : 5 + len(data)]) == data
    assert bytes(r.mem[:5]) == bytes(5) and not any(r.mem[5 + len(data) :])
    ack = r.m.reply(wire.ack(1))
    assert ch.receive.header(memoryview(ack[:5]), memoryview(ack[5:])) is not None


@pytest.mark.parametrize("mode", MODES)
def test_forged_header_lands_nothing(mode: auth.Mode) -> None:
    """A third party that knows the rkey, the region and an immediate, writing into an
    authenticated connection (or starting its own with a made-up key): refused at the header."""
    r = Reader(mode)
    ch = connect(r)
    forger = auth.channel(
        auth.derive(b"x" * 16, b"k" * 32, "trainer", "engine", b"n" * 16, b"m" * 16, mode),
        mode,
        "engine",
        writer=True,
    )
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(sealed(forger, write(65536), b"\xff" * 65536))
    assert err.value.code is ErrorCode.UNAUTHORIZED and "header" in err.value.message
    assert not any(r.mem)
    # a header sealed right but altered on the way (offset changed): refused too
    r = Reader(mode)
    ch = connect(r)
    frame = bytearray(sealed(ch, write(16, offset=0), b"a" * 16))
    frame[8] ^= 0x01
    with pytest.raises(wire.FrameViolation):
        r.feed(bytes(frame))
    assert not any(r.mem)


def test_the_write_tag_is_under_the_header_mac() -> None:
    """A tap that rewrites a frame's `tag` (the version it belongs to, which the receiver
    checks against failed versions) breaks the header's MAC: refused, nothing lands."""
    r = Reader(auth.Mode.AUTH)
    ch = connect(r)
    rkey = auth.plan_rkey(RKEY, "plan-a")
    w = Write(seq=1, region=1, rkey=rkey, offset=0, length=16, imm=1234, tag=1234)
    frame = bytearray(sealed(ch, w, b"a" * 16))
    at = frame.rindex(b"\xcd\x04\xd2")  # msgpack of 1234: the tag, the last header field
    frame[at + 2] ^= 0x01  # 1235
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(bytes(frame))
    assert err.value.code is ErrorCode.UNAUTHORIZED and "header" in err.value.message
    assert not any(r.mem)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_versions_write_is_refused_by_the_authenticated_writers_name(
    mode: auth.Mode,
) -> None:
    """The admission check is asked with the name the handshake proved and refuses a failed
    version's write before any byte of it lands (the region's grants still apply after it)."""
    asked: list[tuple[str, int]] = []

    def admit(node: str, tag: int) -> bool:
        asked.append((node, tag))
        return tag != 9

    r = Reader(mode)
    r.m = wire.ReceiveMachine(
        StreamSink(r.table, admit), handshake.Acceptor("engine", mode, r.tickets)
    )
    ch = connect(r)
    good = Write(seq=1, region=1, rkey=auth.plan_rkey(RKEY, "plan-a"), offset=0, length=8, tag=8)
    (landed,) = r.feed(sealed(ch, good, b"g" * 8))
    assert isinstance(landed, wire.Landed) and bytes(r.mem[:8]) == b"g" * 8
    failed = Write(seq=2, region=1, rkey=good.rkey, offset=8, length=8, tag=9)
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(sealed(ch, failed, b"f" * 8))
    assert err.value.code is ErrorCode.ABORTED and err.value.seq == 2
    assert not any(r.mem[8:]) and asked == [("trainer", 8), ("trainer", 9)]


@pytest.mark.parametrize("mode", MODES)
def test_tampered_payload_is_refused_and_never_counted(mode: auth.Mode) -> None:
    r = Reader(mode)
    ch = connect(r)
    data = os.urandom(MiB + 10)
    frame = bytearray(sealed(ch, write(len(data)), data))
    frame[-100] ^= 0x40  # in the second record
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(bytes(frame))
    assert err.value.code is ErrorCode.UNAUTHORIZED and "payload" in err.value.message
    assert err.value.seq == 1  # the write is refused: no Landed, so no immediate, no ack


def test_unauthenticated_hellos_tickets_of_others_and_replays_are_refused() -> None:
    r = Reader(auth.Mode.AUTH)
    with pytest.raises(wire.FrameViolation) as err:  # the issue's forger: a name and an rkey
        r.feed(wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="trainer")))
    assert err.value.code is ErrorCode.UNAUTHORIZED and "no ticket" in err.value.message
    r = Reader(auth.Mode.AUTH)
    t = r.tickets.issue("insider", auth.Mode.AUTH)
    with pytest.raises(wire.FrameViolation) as err:  # another node's ticket
        r.feed(
            wire.encode(
                DataHello(
                    protocol=PROTOCOL_VERSION, node="trainer", ticket=t.id, nonce=auth.nonce()
                )
            )
        )
    assert "issued to 'insider'" in err.value.message
    # a captured hello replayed: the reader's fresh nonce makes the captured proof useless
    r = Reader(auth.Mode.AUTH)
    t = r.tickets.issue("trainer", auth.Mode.AUTH)
    hello = wire.encode(
        DataHello(protocol=PROTOCOL_VERSION, node="trainer", ticket=t.id, nonce=auth.nonce())
    )
    (first,) = r.feed(hello)
    c1 = wire.decode_header(first.data[0], first.data[5:])
    keys = auth.derive(t.id, t.secret, "trainer", "engine", auth.nonce(), c1.nonce, auth.Mode.AUTH)
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(wire.encode(Proof(proof=keys.writer_proof)))
    assert "failed its proof" in err.value.message
    r = Reader(auth.Mode.AUTH)
    with pytest.raises(wire.FrameViolation):  # a write straight after the hello
        r.feed(
            wire.encode(
                DataHello(
                    protocol=PROTOCOL_VERSION, node="trainer", ticket=t.id, nonce=auth.nonce()
                )
            )
            + wire.encode(write(4))
            + b"abcd"
        )
    assert not any(r.mem)
    r.tickets.revoke("trainer")
    with pytest.raises(auth.AuthError):
        r.tickets.redeem(t.id, "trainer")


@pytest.mark.parametrize("mode", MODES)
def test_an_authenticated_node_that_is_not_a_planned_source_is_refused(mode: auth.Mode) -> None:
    r = Reader(mode)
    ch = connect(r, node="insider")
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(sealed(ch, write(64), b"\xff" * 64))
    assert err.value.code is ErrorCode.UNAUTHORIZED
    assert "insider is not a planned source of region 1" in err.value.message
    assert not any(r.mem)


def test_rkeys_rotate_with_the_plan() -> None:
    r = Reader(auth.Mode.AUTH)
    ch = connect(r)
    assert auth.plan_rkey(RKEY, "plan-a") != auth.plan_rkey(RKEY, "plan-b") != RKEY
    r.table.grant(1, frozenset({"trainer"}), scope="plan-b")
    with pytest.raises(wire.FrameViolation) as err:  # plan a's key, under plan b
        r.feed(sealed(ch, write(8), b"12345678"))
    assert "wrong key" in err.value.message
    assert not any(r.mem)


def test_modes_parse_and_refuse_unknown_names() -> None:
    assert auth.Mode.parse("encrypt") is auth.Mode.ENCRYPT and auth.Mode.parse(1) is auth.Mode.AUTH
    with pytest.raises(ProtocolError):
        auth.Mode.parse("tls")


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=256), st.integers(1, 64), st.sampled_from(MODES))
def test_garbage_on_an_authenticated_connection_is_refused_and_lands_nothing(
    data: bytes, step: int, mode: auth.Mode
) -> None:
    """Whatever an on-path attacker injects after the handshake: a FrameViolation (closing
    the connection), never another exception, never a byte in the region."""
    r = Reader(mode)
    connect(r)
    with contextlib.suppress(wire.FrameViolation):
        r.feed(data, step)
    assert not any(r.mem)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200), st.integers(1, 64))
def test_garbage_before_the_handshake_is_refused(data: bytes, step: int) -> None:
    r = Reader(auth.Mode.AUTH)
    with contextlib.suppress(wire.FrameViolation):
        r.feed(data, step)
    assert not any(r.mem) and r.m.peer is None


def test_elastic_replicas_sharing_a_node_get_each_their_own_replicas_key() -> None:
    """Two engine replicas on one node (two SGLang servers of one host, as slime runs them):
    the sender keys each destination region by the plan of the replica whose engine rank
    owns it (what that rank's node grants it under, `Expect.plan_hash`), not by the node.
    Keyed by node, replica 1's regions got replica 0's key and every write was refused."""
    from weightwire.daemon.plans import _scoped
    from weightwire.protocol.plan import Bucket, NodePlan, RankPlan, ReplicaPart, WriteOp
    from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey

    regions = tuple(
        RegionDescriptor(
            id=i, node="host1", kind="cpu", length=64, keys=RegionKeys(tcp=TcpKey(rkey=RKEY + i))
        )
        for i in range(4)
    )
    writes = tuple(
        WriteOp(src_offset=0, length=8, dst_node="host1", dst_region=i, dst_offset=0, slot=0,
                dst_rank=i)
        for i in range(4)
    )  # fmt: skip
    parts = (
        ReplicaPart(replica=0, plan_hash="replica-0", ranks=(0, 1), nodes=("host1",)),
        ReplicaPart(replica=1, plan_hash="replica-1", ranks=(2, 3), nodes=("host1",)),
    )
    send = RankPlan(
        plan_hash="packs", rank=0, staging_bytes=8, buckets=(Bucket(index=0, writes=writes),),
        regions=regions, replicas=parts,
    )  # fmt: skip
    got = _scoped(NodePlan(plan_hash="node", job="j", sends=(send,))).sends[0].regions
    want = [auth.plan_rkey(RKEY + i, f"replica-{i // 2}") for i in range(4)]
    assert [r.keys.tcp.rkey for r in got if r.keys.tcp is not None] == want
