"""The tcp receive state machine, without sockets: framing, refusals, no stray writes."""

from __future__ import annotations

import pytest

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode
from weightwire.transport.base import LocalRegion
from weightwire.transport.tcp import wire
from weightwire.transport.tcp.data import PREFIX, DataHello, Write
from weightwire.transport.tcp.regions import RegionTable


def machine(size: int = 64) -> tuple[wire.ReceiveMachine, bytearray]:
    mem = bytearray(size)
    table = RegionTable(grant_wait_s=0)
    table.add(LocalRegion(id=1, kind="cpu", length=size, view=memoryview(mem)), rkey=42)
    table.grant(1, frozenset({"peer"}), scope="")
    return wire.ReceiveMachine(table), mem


def feed(m: wire.ReceiveMachine, data: bytes, step: int) -> list[object]:
    """Deliver `data` in pieces of at most `step` bytes; return the finished events."""
    events = []
    while data:
        buf = m.buffer()
        n = min(step, len(buf), len(data))
        buf[:n] = data[:n]
        data = data[n:]
        ev = m.received(n)
        if ev is not None:
            events.append(ev)
    return events


HELLO = wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="peer"))


@pytest.mark.parametrize("step", [1, 3, 7, 4096])
def test_writes_land_whatever_the_fragmentation(step: int) -> None:
    m, mem = machine()
    w1 = Write(seq=1, region=1, rkey=42, offset=3, length=5, imm=77)
    w2 = Write(seq=2, region=1, rkey=42, offset=60, length=4)
    stream = HELLO + wire.encode(w1) + b"ABCDE" + wire.encode(w2) + b"wxyz"
    events = feed(m, stream, step)
    assert [type(e) for e in events] == [wire.HelloReceived, wire.Landed, wire.Landed]
    assert bytes(mem[3:8]) == b"ABCDE" and bytes(mem[60:64]) == b"wxyz"
    assert bytes(mem[:3]) == bytes(3) and bytes(mem[8:60]) == bytes(52)
    assert events[1].write.imm == 77 and events[2].write.imm == -1
    assert m.peer == "peer" and m.bytes_landed == 9


def test_zero_length_write_lands_at_once() -> None:
    m, _ = machine()
    events = feed(
        m, HELLO + wire.encode(Write(seq=9, region=1, rkey=42, offset=64, length=0, imm=1)), 64
    )
    assert isinstance(events[-1], wire.Landed) and events[-1].write.seq == 9


@pytest.mark.parametrize(
    ("frame", "code", "needle"),
    [
        (
            wire.encode(Write(seq=5, region=1, rkey=42, offset=60, length=5)),
            ErrorCode.OUT_OF_BOUNDS,
            "outside",
        ),
        (
            wire.encode(Write(seq=5, region=2, rkey=42, offset=0, length=1)),
            ErrorCode.UNKNOWN_REGION,
            "unknown region",
        ),
        (
            wire.encode(Write(seq=5, region=1, rkey=41, offset=0, length=1)),
            ErrorCode.UNAUTHORIZED,
            "wrong key",
        ),
        (PREFIX.pack(9, 4) + b"xxxx", ErrorCode.MALFORMED, "unknown frame kind"),
        (PREFIX.pack(2, 100000), ErrorCode.MALFORMED, "header of 100000"),
        (PREFIX.pack(2, 3) + b"\xc1\xc1\xc1", ErrorCode.MALFORMED, "undecodable"),
        (
            wire.encode(DataHello(protocol=1, node="again")),
            ErrorCode.MALFORMED,
            "unexpected DataHello",
        ),
    ],
)
def test_refusals(frame: bytes, code: ErrorCode, needle: str) -> None:
    m, mem = machine()
    feed(m, HELLO, 64)
    with pytest.raises(wire.FrameViolation) as err:
        feed(m, frame, 64)
    assert err.value.code is code and needle in err.value.message, err.value
    assert bytes(mem) == bytes(64), "a refused write must not touch memory"


def test_write_before_hello_and_wrong_protocol() -> None:
    m, _ = machine()
    with pytest.raises(wire.FrameViolation) as err:
        feed(m, wire.encode(Write(seq=1, region=1, rkey=42, offset=0, length=1)), 64)
    assert "before the connection was authenticated" in err.value.message
    m, _ = machine()
    with pytest.raises(wire.FrameViolation) as err:
        feed(m, wire.encode(DataHello(protocol=PROTOCOL_VERSION + 1, node="x")), 64)
    assert err.value.code is ErrorCode.UNSUPPORTED_PROTOCOL
