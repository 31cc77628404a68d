"""ZeroMQ multipart framing: `[kind, msgpack header, *raw buffers]`; never pickle.

One `Codec` per socket type, made once, holding the one decoder of that socket's
tagged union. Every failure is a `ProtocolError` that names what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from .errors import ErrorCode, ProtocolError

T = TypeVar("T")

DEFAULT_MAX_BYTES = 16 << 20
HARD_LIMIT_FACTOR = 16
"""Sockets take messages up to this many times their codec's `max_bytes` (and answer them
with a `too_large` error); larger ones ZeroMQ cuts off (MAXMSGSIZE) by dropping the
connection, so that no peer can make a daemon buffer without bound."""


def tag_of(msg: msgspec.Struct) -> str:
    return str(msg.__struct_config__.tag)


def decode_checked(decoder: msgspec.msgpack.Decoder[T], data: Any, what: str) -> T:
    """`decoder.decode(data)`, with msgspec's failures as ProtocolErrors naming `what`:
    INVALID when it decodes but breaks the schema, MALFORMED when it does not decode."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid {what}: {exc}", code=ErrorCode.INVALID) from None
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        # msgspec raises UnicodeDecodeError (a ValueError) for invalid UTF-8 in strings
        raise ProtocolError(f"undecodable {what}: {exc}") from None


def request_id(frames: Sequence[Any]) -> int:
    """The `req` of a message that failed to decode, when it can still be read (else 0),
    so the error reply reaches the caller waiting for it."""
    try:
        raw = msgspec.msgpack.decode(frames[1])
    except Exception:
        return 0
    req = raw.get("req") if isinstance(raw, dict) else None
    return req if isinstance(req, int) and 0 < req < 2**63 else 0


class Codec(Generic[T]):
    def __init__(self, union: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)
        self._encoder = msgspec.msgpack.Encoder()
        self.max_bytes = max_bytes

    def encode(self, msg: msgspec.Struct, *buffers: memoryview | bytes) -> list[Any]:
        return [tag_of(msg).encode(), self._encoder.encode(msg), *buffers]

    def decode(self, frames: Sequence[Any]) -> tuple[T, list[memoryview]]:
        """The message and its raw buffers (zero-copy views of the frames)."""
        if len(frames) < 2:
            raise ProtocolError(f"expected [kind, header, *buffers], got {len(frames)} frame(s)")
        views = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
        size = sum(v.nbytes for v in views)
        if size > self.max_bytes:
            raise ProtocolError(
                f"message of {size} bytes exceeds the limit of {self.max_bytes} bytes",
                code=ErrorCode.TOO_LARGE,
            )
        kind = bytes(views[0])
        msg = decode_checked(self._decoder, views[1], f"{kind!r} message")
        assert isinstance(msg, msgspec.Struct)
        if tag_of(msg).encode() != kind:
            raise ProtocolError(f"frame kind {kind!r} does not match header type {tag_of(msg)!r}")
        return msg, views[2:]
