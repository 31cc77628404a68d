"""The verbs transport's bring-up messages, carried by the daemons' authenticated mesh.

A writer owns its outgoing queue pairs ("links", one per local device and remote device
pair). It asks the destination node to make the matching incoming queue pairs
(`Connect`), to rebuild one after an error (`Reset`), to forget them (`Close`), and
whether a region descriptor is real (`Check`). A destination that fenced a writer's links
tells it so (`Fenced`): their queue pairs are gone, new ones must be brought up. Every
request gets an answer: `Accepted`, `Checked`, or `Refused` with an error code.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from weightwire.protocol.frames import decode_checked
from weightwire.protocol.regions import U64

U24 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]
U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class QpInfo(msgspec.Struct, frozen=True, array_like=True):
    qpn: U24
    psn: U24


class Path(msgspec.Struct, frozen=True, kw_only=True):
    """One end's addressing: what the other end's RTR transition needs."""

    device: str
    gid: str
    lid: int = 0
    mtu: int  # IBV_MTU_* enum
    ethernet: bool = True
    max_msg: int = 0  # the port's max_msg_sz: no WR may be longer (0: unknown)


class Connect(msgspec.Struct, frozen=True, kw_only=True, tag="connect"):
    link: U64
    src: Path  # the writer's device
    dst_device: str  # which of the destination's devices
    qps: tuple[QpInfo, ...]


class Reset(msgspec.Struct, frozen=True, kw_only=True, tag="reset"):
    link: U64
    index: int  # which QP of the link
    qp: QpInfo  # the writer's QP (same number, new PSN)


class Close(msgspec.Struct, frozen=True, kw_only=True, tag="close"):
    link: U64 | None = None  # None: every link of the sender


class Check(msgspec.Struct, frozen=True, kw_only=True, tag="check"):
    region: U64
    device: str
    addr: U64
    rkey: U32
    length: U64


class Fenced(msgspec.Struct, frozen=True, kw_only=True, tag="fenced"):
    links: tuple[U64, ...]  # the writer's links whose queue pairs the destination destroyed


Request = Connect | Reset | Close | Check | Fenced


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted"):
    path: Path | None = None
    qps: tuple[QpInfo, ...] = ()
    recv_depth: int = 0


class Checked(msgspec.Struct, frozen=True, kw_only=True, tag="checked"):
    pass


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    code: str
    message: str


Reply = Accepted | Checked | Refused

_enc = msgspec.msgpack.Encoder()
_req: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
_rep: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _enc.encode(msg)


def decode_request(data: bytes) -> Request:
    return decode_checked(_req, data, "verbs request")


def decode_reply(data: bytes) -> Reply:
    return decode_checked(_rep, data, "verbs reply")
