"""Fuzz targets shared by hypothesis (tests/test_fuzz.py) and atheris (tests/fuzz/run_atheris.py).

Each target takes raw bytes and must either accept them or raise the typed error its
boundary promises; anything else (a crash, a stray write) is a failure.
"""

from __future__ import annotations

import msgspec

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ProtocolError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import LocalMessage
from weightwire.protocol.peer import PeerMessage
from weightwire.transport.base import LocalRegion
from weightwire.transport.tcp import wire
from weightwire.transport.tcp.data import DataHello, Write
from weightwire.transport.tcp.regions import RegionTable

LOCAL = Codec(LocalMessage, max_bytes=1 << 16)
PEER = Codec(PeerMessage, max_bytes=1 << 16)
GUARD, REGION, RKEY = 256, 4096, 7


def split_frames(data: bytes) -> list[bytes]:
    """Bytes to a multipart message: 0xFF 0xFE separates frames."""
    return data.split(b"\xff\xfe")


def control(codec: Codec, data: bytes) -> None:
    try:
        msg, _ = codec.decode(split_frames(data))
    except ProtocolError:
        return
    # whatever decodes must encode back to something that decodes to the same message
    again, _ = codec.decode(codec.encode(msg))
    assert again == msg


def local_decoder(data: bytes) -> None:
    control(LOCAL, data)


def peer_decoder(data: bytes) -> None:
    control(PEER, data)


class Memory:
    """A region with guard bytes on both sides that no input may ever touch."""

    def __init__(self) -> None:
        self.buf = bytearray(b"\xaa" * (GUARD + REGION + GUARD))
        view = memoryview(self.buf)[GUARD : GUARD + REGION]
        self.table = RegionTable(grant_wait_s=0)
        self.table.add(LocalRegion(id=1, kind="cpu", length=REGION, view=view), rkey=RKEY)
        self.table.grant(1, frozenset({"peer"}), scope="")

    def guards_intact(self) -> bool:
        return self.buf[:GUARD] == b"\xaa" * GUARD and self.buf[-GUARD:] == b"\xaa" * GUARD


def frame_parser(data: bytes) -> None:
    """Feed bytes through the tcp receive machine in chunks chosen by the input itself."""
    mem = Memory()
    m = wire.ReceiveMachine(mem.table)
    step = (data[0] % 61 + 1) if data else 1
    rest = data[1:]
    try:
        while rest:
            buf = m.buffer()
            n = min(step, len(buf), len(rest))
            if n == 0:
                break
            buf[:n] = rest[:n]
            rest = rest[n:]
            m.received(n)
    except wire.FrameViolation:
        pass
    assert mem.guards_intact(), "a frame wrote outside its region"


def seeds() -> list[bytes]:
    """Valid inputs for the fuzzers to mutate from."""
    hello = wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="peer"))
    write = wire.encode(Write(seq=1, region=1, rkey=RKEY, offset=100, length=16, imm=5))
    oob = wire.encode(Write(seq=2, region=1, rkey=RKEY, offset=REGION - 8, length=16))
    local = LOCAL.encode(
        msgspec.convert({"type": "wait_version", "version": 3, "req": 1}, LocalMessage)
    )
    return [
        b"\x07" + hello + write + bytes(range(16)),
        b"\x01" + hello + oob + bytes(16),
        b"\xff\xfe".join(local),
        b"hello\xff\xfe"
        + msgspec.msgpack.encode({"type": "hello", "protocol": 1, "role": "engine"}),
        b"heartbeat\xff\xfe"
        + msgspec.msgpack.encode({"type": "heartbeat", "node": "n", "incarnation": "i"}),
    ]


TARGETS = {"local": local_decoder, "peer": peer_decoder, "frames": frame_parser}
