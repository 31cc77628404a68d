"""Encoding and I/O-free parsing of tcp data frames (see weightwire.protocol.data).

`ReceiveMachine` is the whole receive side without sockets: the caller asks it for
the buffer to fill next (`buffer()`), receives into it, and reports how many bytes
arrived (`received(n)`). Payloads are received straight into the destination
memory that `WriteSink.target` returns, so there is no intermediate copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import msgspec

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.data import (
    KIND,
    MAX_HEADER,
    PREFIX,
    Ack,
    DataFrame,
    DataHello,
    DataMessage,
    Refused,
    Write,
)
from weightwire.protocol.errors import ErrorCode, ProtocolError, WeightwireError
from weightwire.protocol.frames import decode_checked

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[DataMessage] = msgspec.msgpack.Decoder(DataMessage)


def encode(frame: DataFrame) -> bytes:
    header = _encoder.encode(frame)
    return PREFIX.pack(KIND[type(frame)], len(header)) + header


def decode_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    kind, hlen = PREFIX.unpack(prefix)
    if kind not in KIND.values():
        raise ProtocolError(f"unknown frame kind {kind}")
    if not 0 < hlen <= MAX_HEADER:
        raise ProtocolError(f"frame header of {hlen} bytes (limit {MAX_HEADER})")
    return kind, hlen


def decode_header(kind: int, header: bytes | memoryview) -> DataMessage:
    msg = decode_checked(_decoder, header, "frame header")
    if KIND[type(msg)] != kind:
        raise ProtocolError(f"frame kind {kind} does not match header {type(msg).__name__}")
    return msg


class WriteSink(Protocol):
    """Where incoming writes land. `target` raises RegionError for a write it refuses."""

    def target(self, write: Write) -> memoryview: ...

    def landed(self, write: Write) -> None: ...


@dataclass(frozen=True, slots=True)
class Landed:
    write: Write


@dataclass(frozen=True, slots=True)
class HelloReceived:
    hello: DataHello


class _Stage(enum.Enum):
    PREFIX = 1
    HEADER = 2
    PAYLOAD = 3


class FrameViolation(WeightwireError):
    """The peer sent something this side refuses; the connection must be closed."""

    def __init__(self, error: WeightwireError, seq: int) -> None:
        super().__init__(error.message, code=error.code)
        self.seq = seq


class ReceiveMachine:
    """Parses one direction of a data connection: DataHello first, then Writes."""

    def __init__(self, sink: WriteSink) -> None:
        self._sink = sink
        self._small = bytearray(PREFIX.size + MAX_HEADER)
        self._small_view = memoryview(self._small)
        self._stage = _Stage.PREFIX
        self._kind = 0
        self._hlen = 0
        self._filled = 0
        self._payload: memoryview | None = None
        self._write: Write | None = None
        self.peer: str | None = None
        self.bytes_landed = 0

    @property
    def mid_frame(self) -> bool:
        return self._stage is not _Stage.PREFIX or self._filled > 0

    def buffer(self) -> memoryview:
        """The memory to receive into next: exactly the rest of the current stage."""
        match self._stage:
            case _Stage.PREFIX:
                return self._small_view[self._filled : PREFIX.size]
            case _Stage.HEADER:
                return self._small_view[PREFIX.size + self._filled : PREFIX.size + self._hlen]
            case _Stage.PAYLOAD:
                assert self._payload is not None
                return self._payload[self._filled :]

    def received(self, n: int) -> Landed | HelloReceived | None:
        """Account for `n` bytes received into `buffer()`; returns a finished event, if any.

        Raises FrameViolation for anything the connection must be closed over.
        """
        self._filled += n
        match self._stage:
            case _Stage.PREFIX:
                if self._filled == PREFIX.size:
                    try:
                        self._kind, self._hlen = decode_prefix(self._small_view[: PREFIX.size])
                    except WeightwireError as exc:
                        raise FrameViolation(exc, 0) from None
                    self._stage, self._filled = _Stage.HEADER, 0
                return None
            case _Stage.HEADER:
                if self._filled < self._hlen:
                    return None
                header = self._small_view[PREFIX.size : PREFIX.size + self._hlen]
                return self._on_header(header)
            case _Stage.PAYLOAD:
                assert self._payload is not None and self._write is not None
                if self._filled < len(self._payload):
                    return None
                return self._finish_write()

    def _on_header(self, header: memoryview) -> Landed | HelloReceived | None:
        try:
            msg = decode_header(self._kind, header)
        except WeightwireError as exc:
            raise FrameViolation(exc, 0) from None
        self._stage, self._filled = _Stage.PREFIX, 0
        match msg:
            case DataHello(protocol=protocol, node=node) if self.peer is None:
                if protocol != PROTOCOL_VERSION:
                    raise FrameViolation(
                        ProtocolError(
                            f"peer {node} speaks data protocol {protocol}, "
                            f"this side {PROTOCOL_VERSION}",
                            code=ErrorCode.UNSUPPORTED_PROTOCOL,
                        ),
                        0,
                    )
                self.peer = node
                return HelloReceived(msg)
            case Write() if self.peer is None:
                raise FrameViolation(ProtocolError("write before hello"), msg.seq)
            case Write():
                try:
                    target = self._sink.target(msg)
                except WeightwireError as exc:
                    raise FrameViolation(exc, msg.seq) from None
                if len(target) != msg.length:
                    raise FrameViolation(
                        WeightwireError(f"sink gave {len(target)} bytes for {msg.length}"), msg.seq
                    )
                self._write, self._payload = msg, target
                if msg.length == 0:
                    return self._finish_write()
                self._stage = _Stage.PAYLOAD
                return None
            case _:
                raise FrameViolation(
                    ProtocolError(f"unexpected {type(msg).__name__} frame on a receive stream"),
                    getattr(msg, "seq", 0),
                )

    def _finish_write(self) -> Landed:
        write = self._write
        assert write is not None
        self._sink.landed(write)
        self.bytes_landed += write.length
        self._write, self._payload = None, None
        self._stage, self._filled = _Stage.PREFIX, 0
        return Landed(write)


def ack(seq: int) -> bytes:
    return encode(Ack(seq=seq))


def refused(seq: int, error: WeightwireError) -> bytes:
    return encode(Refused(seq=seq, code=error.code.value, message=error.message))
