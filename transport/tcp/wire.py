"""Encoding and I/O-free parsing of tcp data frames (see weightwire.transport.tcp.data).

`ReceiveMachine` is the whole receive side without sockets: the caller asks it for
the buffer to fill next (`buffer()`), receives into it, and reports how many bytes
arrived (`received(n)`). Payloads are received straight into the destination
memory that `WriteSink.target` returns, so there is no intermediate copy (encrypted
records are decrypted from a record-sized buffer into it: the one pass decryption needs).
A sink may give a write's memory in pieces (a GPU region's, through a bounded bounce
buffer): the machine asks for the next piece (`WriteSink.piece`) once every byte of the
one before is in and checked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import msgspec

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, ProtocolError, WeightwireError
from weightwire.protocol.frames import decode_checked
from weightwire.transport.tcp.data import (
    KIND,
    MAX_HEADER,
    PREFIX,
    Ack,
    Challenge,
    DataFrame,
    DataHello,
    DataMessage,
    Proof,
    Refused,
    Write,
)

from . import auth

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
    """Where incoming writes land. `target` raises a WeightwireError for a write it refuses
    (`peer` is the authenticated writer), and gives the memory the write's first bytes land
    in: all of them, or a first piece. Every piece but a write's last is a whole number of
    `auth.RECORD`s (no sealed record straddles two). `piece` gives the next once the
    first `done` bytes are in and checked; `landed` once every byte is there and checked.
    Either raises a WeightwireError for memory it failed to give or fill (the write fails).
    `private`: the stream's own code stores the bytes (it decrypts them): the memory must be
    the sink's own, never a mapping another process can shrink (`sink.py`)."""

    def target(self, write: Write, peer: str, private: bool = False) -> memoryview: ...

    def piece(self, write: Write, done: int) -> memoryview: ...

    def landed(self, write: Write) -> None: ...


class Acceptor(Protocol):
    """The reader's end of the handshake (handshake.Acceptor): a challenge for a hello (None:
    accepted unauthenticated), a channel for a good proof; AuthError otherwise."""

    def hello(self, hello: DataHello) -> Challenge | None: ...

    def proof(self, proof: Proof) -> auth.Channel: ...


@dataclass(frozen=True, slots=True)
class Landed:
    write: Write


@dataclass(frozen=True, slots=True)
class HelloReceived:
    """The peer is known (authenticated, unless both ends run without authentication)."""

    hello: DataHello


@dataclass(frozen=True, slots=True)
class Reply:
    """Bytes the receive side must send back now (the handshake's challenge)."""

    data: bytes


Event = Landed | HelloReceived | Reply


class _Stage(enum.Enum):
    PREFIX = 1
    HEADER = 2
    PAYLOAD = 3
    TAG = 4  # the tag after an authenticated (not encrypted) payload record


class FrameViolation(WeightwireError):
    """The peer sent something this side refuses; the connection must be closed."""

    def __init__(self, error: WeightwireError, seq: int) -> None:
        super().__init__(error.message, code=error.code)
        self.seq = seq


class ReceiveMachine:
    """Parses one direction of a data connection: DataHello first (then, authenticated,
    Proof), then Writes. Without an acceptor it takes unauthenticated hellos only."""

    def __init__(self, sink: WriteSink, acceptor: Acceptor | None = None) -> None:
        self._sink = sink
        self._acceptor = acceptor
        self._small = bytearray(PREFIX.size + MAX_HEADER + auth.TAG)
        self._small_view = memoryview(self._small)
        self._stage = _Stage.PREFIX
        self._kind = 0
        self._hlen = 0
        self._filled = 0
        self._payload: memoryview | None = None  # the write's destination (piece) now
        self._base = 0  # the payload offset where `_payload` begins
        self._record: memoryview | None = None  # what the current record is received into
        self._done = 0  # payload bytes received and checked
        self._scratch: memoryview | None = None  # encrypted records land here first
        self._write: Write | None = None
        self._hello: DataHello | None = None
        self.channel: auth.Channel | None = None
        self.peer: str | None = None
        self.bytes_landed = 0

    @property
    def mid_frame(self) -> bool:
        return self._stage is not _Stage.PREFIX or self._filled > 0

    def _header_bytes(self) -> int:
        return self._hlen + (auth.TAG if self.channel is not None else 0)

    def buffer(self) -> memoryview:
        """The memory to receive into next: exactly the rest of the current stage."""
        match self._stage:
            case _Stage.PREFIX:
                return self._small_view[self._filled : PREFIX.size]
            case _Stage.HEADER:
                end = PREFIX.size + self._header_bytes()
                return self._small_view[PREFIX.size + self._filled : end]
            case _Stage.PAYLOAD:
                assert self._record is not None
                return self._record[self._filled :]
            case _Stage.TAG:
                return self._small_view[self._filled : auth.TAG]

    def received(self, n: int) -> Event | None:
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
                if self._filled < self._header_bytes():
                    return None
                return self._on_header()
            case _Stage.PAYLOAD:
                assert self._record is not None
                if self._filled < len(self._record):
                    return None
                return self._on_record()
            case _Stage.TAG:
                if self._filled < auth.TAG:
                    return None
                return self._on_tag()

    def _on_header(self) -> Event | None:
        sealed = self._small_view[PREFIX.size : PREFIX.size + self._header_bytes()]
        try:
            header = sealed
            if self.channel is not None:
                header = memoryview(
                    self.channel.receive.header(self._small_view[: PREFIX.size], sealed)
                )
            msg = decode_header(self._kind, header)
        except WeightwireError as exc:
            raise FrameViolation(exc, 0) from None
        self._stage, self._filled = _Stage.PREFIX, 0
        match msg:
            case DataHello() if self._hello is None:
                return self._on_hello(msg)
            case Proof() if self._hello is not None and self.peer is None:
                assert self._acceptor is not None
                try:
                    self.channel = self._acceptor.proof(msg)
                except WeightwireError as exc:
                    raise FrameViolation(exc, 0) from None
                self.peer = self.channel.peer
                return HelloReceived(self._hello)
            case Write():
                if self.peer is None:
                    raise FrameViolation(
                        auth.AuthError("write before the connection was authenticated"), msg.seq
                    )
                private = self.channel is not None and self.channel.mode is auth.Mode.ENCRYPT
                try:
                    target = self._sink.target(msg, self.peer, private)
                except WeightwireError as exc:
                    raise FrameViolation(exc, msg.seq) from None
                self._write, self._done = msg, 0
                self._take(target)
                if msg.length == 0:
                    return self._finish_write()
                self._next_record()
                return None
            case _:
                raise FrameViolation(
                    ProtocolError(f"unexpected {type(msg).__name__} frame on a receive stream"),
                    getattr(msg, "seq", 0),
                )

    def _on_hello(self, hello: DataHello) -> Event:
        self._hello = hello
        try:
            check_protocol(hello)
            if self._acceptor is not None:
                challenge = self._acceptor.hello(hello)
            elif hello.ticket:
                raise auth.AuthError("this side takes no authenticated connections")
            else:
                challenge = None
        except WeightwireError as exc:
            raise FrameViolation(exc, 0) from None
        if challenge is not None:
            return Reply(encode(challenge))
        self.peer = hello.node
        return HelloReceived(hello)

    def _take(self, piece: memoryview) -> None:
        """`piece` as where the payload's bytes from `_done` on land: all the rest, or a
        part of it that leaves no sealed record straddling two pieces."""
        assert self._write is not None
        left = self._write.length - self._done
        n = len(piece)
        if not (0 < n <= left or n == left == 0) or (n < left and n % auth.RECORD):
            raise FrameViolation(
                WeightwireError(f"sink gave {n} bytes for {left} at byte {self._done}"),
                self._write.seq,
            )
        self._payload, self._base = piece, self._done

    def _next_record(self) -> None:
        """Point the payload stage at the next record (the whole piece without a channel)."""
        assert self._payload is not None
        at = self._done - self._base
        left = len(self._payload) - at
        ch = self.channel
        if ch is None:
            self._record = self._payload[at:]
        elif ch.mode is auth.Mode.ENCRYPT:
            if self._scratch is None:
                self._scratch = memoryview(bytearray(auth.RECORD + auth.TAG))
            self._record = self._scratch[: min(left, auth.RECORD) + auth.TAG]
        else:
            self._record = self._payload[at : at + min(left, auth.RECORD)]
        self._stage, self._filled = _Stage.PAYLOAD, 0

    def _on_record(self) -> Event | None:
        assert self._record is not None and self._payload is not None
        ch = self.channel
        if ch is None:
            self._done = self._base + len(self._payload)
        elif ch.mode is auth.Mode.ENCRYPT:
            n = len(self._record) - auth.TAG
            at = self._done - self._base
            try:
                ch.receive.decrypt_record(self._record, self._payload[at : at + n])
            except WeightwireError as exc:
                raise FrameViolation(exc, self._seq()) from None
            self._done += n
        else:
            self._stage, self._filled = _Stage.TAG, 0
            return None
        return self._after_record()

    def _on_tag(self) -> Event | None:
        assert self._record is not None and self.channel is not None
        try:
            self.channel.receive.check_record(self._record, self._small_view[: auth.TAG])
        except WeightwireError as exc:
            raise FrameViolation(exc, self._seq()) from None
        self._done += len(self._record)
        return self._after_record()

    def _after_record(self) -> Event | None:
        assert self._payload is not None and self._write is not None
        if self._done < self._write.length:
            if self._done == self._base + len(self._payload):  # the piece is full: the next
                try:
                    piece = self._sink.piece(self._write, self._done)
                except WeightwireError as exc:
                    raise FrameViolation(exc, self._write.seq) from None
                self._take(piece)
            self._next_record()
            return None
        return self._finish_write()

    def _seq(self) -> int:
        return self._write.seq if self._write is not None else 0

    @property
    def write(self) -> Write | None:
        """The write whose payload is under way, if any."""
        return self._write if self._stage in (_Stage.PAYLOAD, _Stage.TAG) else None

    def _finish_write(self) -> Landed:
        write = self._write
        assert write is not None
        try:
            self._sink.landed(write)
        except WeightwireError as exc:  # its last bytes never reached the memory: refused
            raise FrameViolation(exc, write.seq) from None
        self.bytes_landed += write.length
        self._write, self._payload, self._record = None, None, None
        self._stage, self._filled = _Stage.PREFIX, 0
        return Landed(write)

    def reply(self, frame: DataFrame) -> bytes:
        """A frame to send back to the peer, sealed once the connection is authenticated."""
        return seal(encode(frame), self.channel.send if self.channel is not None else None)


def check_protocol(hello: DataHello) -> None:
    if hello.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer {hello.node} speaks data protocol {hello.protocol}, "
            f"this side {PROTOCOL_VERSION}",
            code=ErrorCode.UNSUPPORTED_PROTOCOL,
        )


def seal(frame: bytes, sealer: auth.Sealer | None) -> bytes:
    """An encoded frame as it goes on an authenticated connection (unchanged without one)."""
    if sealer is None:
        return frame
    return sealer.header(frame[: PREFIX.size], frame[PREFIX.size :])


def ack(seq: int) -> Ack:
    return Ack(seq=seq)


def refused(seq: int, error: WeightwireError) -> Refused:
    return Refused(seq=seq, code=error.code.value, message=error.message)
