"""What a delta version puts in an engine's delta area: payloads and trailers.

A **payload** is one bucket's changes for one destination rank: a 64-byte header (the
version, the base version the changes are against, the encoding), the destination
blocks its stream covers (region, offset, length, count, stride: the planned writes, in
order), then the encoded body (8-byte aligned). It is self-describing, so the engine
needs no plan to apply it.

A **trailer** closes a version from one sender rank to one destination rank: the
version, the base of its payloads, a checksum of every range the sender wrote to that
rank this version (dense or delta), those ranges, and where its payloads are in the area.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from weightwire.protocol.plan import DELTA_HEAD as HEAD
from weightwire.protocol.plan import DELTA_RANGE as RANGE
from weightwire.protocol.plan import DELTA_REF
from weightwire.protocol.plan import trailer_capacity as trailer_size

PAYLOAD_MAGIC = b"WWDP"
TRAILER_MAGIC = b"WWDT"
_PAYLOAD = struct.Struct("<4sBBHI4xQqQQQ")
_TRAILER = struct.Struct("<4sIIIQqQ")

Range = tuple[int, int, int, int, int]
"""(region, offset, length, count, stride) of a write at its destination."""


class FrameError(ValueError):
    """Bytes in a delta area that are not a well-formed payload or trailer."""


def align8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class PayloadHead:
    kind: int
    width: int
    version: int
    base: int
    elements: int
    count: int
    body_len: int
    blocks: tuple[Range, ...]

    @property
    def body_offset(self) -> int:
        return body_offset(len(self.blocks))

    @property
    def size(self) -> int:
        return self.body_offset + self.body_len


def body_offset(n_blocks: int) -> int:
    return align8(HEAD + RANGE * n_blocks)


def payload_head(h: PayloadHead) -> bytes:
    """Header and block table of a payload (its body follows at `h.body_offset`)."""
    out = bytearray(h.body_offset)
    _PAYLOAD.pack_into(
        out, 0, PAYLOAD_MAGIC, h.kind, h.width, 0, len(h.blocks),
        h.version, h.base, h.elements, h.count, h.body_len,
    )  # fmt: skip
    if h.blocks:
        out[HEAD : HEAD + RANGE * len(h.blocks)] = np.asarray(h.blocks, dtype="<u8").tobytes()
    return bytes(out)


def read_payload_head(buf: bytes | memoryview, limit: int) -> PayloadHead:
    if len(buf) < HEAD:
        raise FrameError(f"a payload of {len(buf)} bytes has no header")
    magic, kind, width, _, nb, version, base, n, k, body_len = _PAYLOAD.unpack_from(buf, 0)
    if magic != PAYLOAD_MAGIC:
        raise FrameError(f"not a delta payload (magic {magic!r})")
    if body_offset(nb) > len(buf):
        raise FrameError(f"payload names {nb} blocks; only {len(buf)} bytes were read")
    table = np.frombuffer(buf, dtype="<u8", count=5 * nb, offset=HEAD).reshape(nb, 5)
    head = PayloadHead(
        kind,
        width,
        version,
        base,
        n,
        k,
        body_len,
        tuple(tuple(map(int, r)) for r in table),  # type: ignore[misc]
    )
    if head.size > limit:
        raise FrameError(f"payload of {head.size} bytes overruns its {limit}")
    return head


def blocks_bytes(blocks: tuple[Range, ...]) -> int:
    return sum(length * count for _, _, length, count, _ in blocks)


@dataclass(frozen=True)
class TrailerHead:
    sender: int
    version: int
    base: int
    digest: int
    ranges: tuple[Range, ...]
    deltas: tuple[tuple[int, int], ...]  # (offset in the area, length) of each payload

    @property
    def size(self) -> int:
        return trailer_size(len(self.ranges), len(self.deltas))


def trailer(t: TrailerHead) -> bytes:
    out = bytearray(t.size)
    _TRAILER.pack_into(
        out, 0, TRAILER_MAGIC, t.sender, len(t.ranges), len(t.deltas), t.version, t.base,
        t.digest,
    )  # fmt: skip
    at = HEAD
    if t.ranges:
        out[at : at + RANGE * len(t.ranges)] = np.asarray(t.ranges, dtype="<u8").tobytes()
    at += RANGE * len(t.ranges)
    if t.deltas:
        out[at : at + DELTA_REF * len(t.deltas)] = np.asarray(t.deltas, dtype="<u8").tobytes()
    return bytes(out)


def read_trailer(buf: bytes | memoryview) -> TrailerHead:
    if len(buf) < HEAD:
        raise FrameError(f"a trailer of {len(buf)} bytes has no header")
    magic, sender, nr, nd, version, base, digest = _TRAILER.unpack_from(buf, 0)
    if magic != TRAILER_MAGIC:
        raise FrameError(f"not a delta trailer (magic {magic!r})")
    if trailer_size(nr, nd) > len(buf):
        raise FrameError(f"trailer names {nr} ranges and {nd} payloads: more than its slot")
    ranges = np.frombuffer(buf, dtype="<u8", count=5 * nr, offset=HEAD).reshape(nr, 5)
    deltas = np.frombuffer(buf, dtype="<u8", count=2 * nd, offset=HEAD + RANGE * nr)
    return TrailerHead(
        sender,
        version,
        base,
        digest,
        tuple(tuple(map(int, r)) for r in ranges),  # type: ignore[misc]
        tuple(tuple(map(int, d)) for d in deltas.reshape(nd, 2)),  # type: ignore[misc]
    )
