"""Frame headers of the tcp transport's data connections.

A frame is `kind (u8) | header length (u32 LE) | msgpack header | payload`, where
only `Write` has a payload (`length` bytes). The kind byte must agree with the
header's tag.

A connection opens with `DataHello`. When it is authenticated (transport/tcp/auth.py)
the reader answers `Challenge`, the writer `Proof`, and from then on each header is
followed by a 16-byte MAC tag (the header length counts the header only) and a payload
goes as records of at most 1 MiB, each followed by its MAC tag. The MAC of a header covers
all of it, `Write.tag` (the write's immediate, checked against failed versions) included.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from weightwire.protocol.regions import U64
from weightwire.protocol.tensors import NonNeg

PREFIX = struct.Struct("<BI")
MAX_HEADER = 4096


class DataFrame(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", array_like=True):
    pass


class DataHello(DataFrame, frozen=True, tag=1):
    protocol: int
    node: str
    ticket: bytes = b""  # issued by the reader over the control channel ("" = unauthenticated)
    nonce: bytes = b""  # the writer's handshake nonce


class Write(DataFrame, frozen=True, tag=2):
    seq: NonNeg
    region: NonNeg
    rkey: U64
    offset: NonNeg
    length: NonNeg
    imm: Annotated[int, msgspec.Meta(ge=-1, lt=2**32)] = -1  # -1: no immediate
    # the immediate of the write this frame is part of, on every frame of it (-1: none), so
    # that the receiver can refuse a failed version's bytes before any of them land
    tag: Annotated[int, msgspec.Meta(ge=-1, lt=2**32)] = -1


class Ack(DataFrame, frozen=True, tag=3):
    seq: NonNeg


class Refused(DataFrame, frozen=True, tag=4):
    seq: NonNeg
    code: str
    message: str


class Challenge(DataFrame, frozen=True, tag=5):
    """The reader's answer to an authenticated hello: its nonce, the connection's mode
    (1 authenticated, 2 encrypted) and its proof that it holds the ticket's secret."""

    nonce: bytes
    mode: int
    proof: bytes


class Proof(DataFrame, frozen=True, tag=6):
    """The writer's proof that it holds the ticket's secret (nothing else is accepted first)."""

    proof: bytes


DataMessage = DataHello | Write | Ack | Refused | Challenge | Proof

KIND: dict[type[DataFrame], int] = {
    DataHello: 1,
    Write: 2,
    Ack: 3,
    Refused: 4,
    Challenge: 5,
    Proof: 6,
}
