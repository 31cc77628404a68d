"""Frame headers of the tcp transport's data connections.

A frame is `kind (u8) | header length (u32 LE) | msgpack header | payload`, where
only `Write` has a payload (`length` bytes). The kind byte must agree with the
header's tag.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from .regions import U64
from .tensors import NonNeg

PREFIX = struct.Struct("<BI")
MAX_HEADER = 4096


class DataFrame(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", array_like=True):
    pass


class DataHello(DataFrame, frozen=True, tag=1):
    protocol: int
    node: str


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


DataMessage = DataHello | Write | Ack | Refused

KIND: dict[type[DataFrame], int] = {DataHello: 1, Write: 2, Ack: 3, Refused: 4}
