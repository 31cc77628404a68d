"""Peer authentication and frame protection on tcp data connections.

Key agreement rides on the daemons' CURVE-authenticated control channel: before it
opens data connections, a writer asks the destination's tcp transport (a transport
signal, `TicketRequest`) for a ticket, a random id and a 32-byte secret that the
destination issues to the node name the control channel authenticated. Each
connection then proves it holds the secret, with fresh nonces from both ends:

    writer -> DataHello(node, ticket id, writer nonce)
    reader -> Challenge(reader nonce, mode, reader proof)
    writer -> Proof(writer proof)

Both ends derive one AES-256-GCM key per direction from the secret and both nonces
(keyed BLAKE2b). From then on every frame header carries a 16-byte tag (`AUTH`: header
in clear and authenticated; `ENCRYPT`: header encrypted), and a write's payload goes as
records of at most `RECORD` bytes, each followed by its tag (`AUTH`: GMAC of the bytes;
`ENCRYPT`: AES-GCM ciphertext). The nonce is a per-direction frame counter, so nothing
can be replayed, reordered, cut out or moved to another connection.

A receiver checks a header's tag before it looks at what the header names, so a forged
header lands nothing. A payload record lands in the destination before its tag is
checked (that is what keeps receiving zero-copy); a bad tag refuses the write, closes
the connection and withholds the immediate, so tampered bytes can only be part of a
version that fails, never of one reported complete.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
import threading
import time
from dataclasses import dataclass

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from weightwire.protocol.errors import ErrorCode, ProtocolError, TransferError
from weightwire.protocol.regions import RegionDescriptor, TcpKey

TAG = 16  # bytes of every tag
NONCE = 16  # bytes of each end's handshake nonce
RECORD = 1 << 20  # payload bytes per sealed record
TICKET_TTL_S = 60.0  # how long a ticket may be redeemed by new connections
TICKETS_PER_NODE = 4  # the newest tickets of a node that stay valid


class Mode(enum.IntEnum):
    """What protects a data connection; the stronger of the two ends' settings wins."""

    OFF = 0  # nothing: any host that reaches the port and knows an rkey can write
    AUTH = 1  # the peer is authenticated, every header, immediate and payload byte MACed
    ENCRYPT = 2  # as AUTH, and headers and payloads encrypted

    @classmethod
    def parse(cls, value: str | int | Mode) -> Mode:
        if isinstance(value, Mode):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.upper()]
        except KeyError:
            raise ProtocolError(
                f"unknown tcp security {value!r} (off, auth or encrypt)", code=ErrorCode.INVALID
            ) from None


class AuthError(TransferError):
    """A data connection or frame failed authentication."""

    code = ErrorCode.UNAUTHORIZED


# --- the ticket exchange, over the control channel -------------------------------


class TicketRequest(msgspec.Struct, frozen=True, kw_only=True, tag="ticket_request"):
    mode: int  # the writer's setting


class TicketGrant(msgspec.Struct, frozen=True, kw_only=True, tag="ticket_grant"):
    ticket: bytes
    secret: bytes
    mode: int  # what the connections will use: the stronger of both settings


class TicketRefused(msgspec.Struct, frozen=True, kw_only=True, tag="ticket_refused"):
    code: str
    message: str


TicketReply = TicketGrant | TicketRefused
_req_decoder = msgspec.msgpack.Decoder(TicketRequest)
_reply_decoder: msgspec.msgpack.Decoder[TicketReply] = msgspec.msgpack.Decoder(TicketReply)


def encode(msg: TicketRequest | TicketGrant | TicketRefused) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode_request(data: bytes) -> TicketRequest:
    try:
        return _req_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad tcp ticket request: {exc}") from None


def decode_reply(data: bytes) -> TicketReply:
    try:
        return _reply_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad tcp ticket reply: {exc}") from None


@dataclass(frozen=True, slots=True)
class Ticket:
    id: bytes
    secret: bytes
    node: str  # the writer it was issued to (as the control channel authenticated it)
    mode: Mode
    expires: float


class Tickets:
    """The tickets a receiver has issued (issued on the loop, redeemed by receive threads)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._by_id: dict[bytes, Ticket] = {}
        self._lock = threading.Lock()

    def issue(self, node: str, mode: Mode) -> Ticket:
        ticket = Ticket(
            id=secrets.token_bytes(16),
            secret=secrets.token_bytes(32),
            node=node,
            mode=mode,
            expires=time.monotonic() + self.ttl_s,
        )
        with self._lock:
            now = time.monotonic()
            mine = sorted(
                (t for t in self._by_id.values() if t.node == node), key=lambda t: t.expires
            )
            for old in mine[: max(0, len(mine) - TICKETS_PER_NODE + 1)]:
                del self._by_id[old.id]
            for old in [t for t in self._by_id.values() if t.expires < now]:
                del self._by_id[old.id]
            self._by_id[ticket.id] = ticket
        return ticket

    def redeem(self, ticket_id: bytes, node: str) -> Ticket:
        with self._lock:
            ticket = self._by_id.get(ticket_id)
        if ticket is None or ticket.expires < time.monotonic():
            raise AuthError(f"data connection from {node!r} with an unknown or expired ticket")
        if ticket.node != node:
            raise AuthError(
                f"data connection claims to be {node!r} with a ticket issued to {ticket.node!r}"
            )
        return ticket

    def revoke(self, node: str) -> None:
        """Forget `node`'s tickets (it was lost): it must ask again to connect."""
        with self._lock:
            for t in [t for t in self._by_id.values() if t.node == node]:
                del self._by_id[t.id]


# --- per-connection keys ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Keys:
    writer_to_reader: bytes
    reader_to_writer: bytes
    reader_proof: bytes
    writer_proof: bytes


def _kdf(secret: bytes, label: bytes, transcript: bytes) -> bytes:
    return hashlib.blake2b(transcript, key=secret, person=label, digest_size=32).digest()


def derive(
    ticket: bytes,
    secret: bytes,
    writer: str,
    reader: str,
    writer_nonce: bytes,
    reader_nonce: bytes,
    mode: Mode,
) -> Keys:
    """A connection's keys and proofs, bound to both names, both nonces and the mode."""
    if len(writer_nonce) != NONCE or len(reader_nonce) != NONCE:
        raise AuthError("handshake nonces of the wrong size")
    transcript = msgspec.msgpack.encode(
        [ticket, writer, reader, writer_nonce, reader_nonce, int(mode)]
    )
    return Keys(
        writer_to_reader=_kdf(secret, b"ww-tcp-w2r", transcript),
        reader_to_writer=_kdf(secret, b"ww-tcp-r2w", transcript),
        reader_proof=_kdf(secret, b"ww-tcp-rproof", transcript),
        writer_proof=_kdf(secret, b"ww-tcp-wproof", transcript),
    )


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE)


# --- frame protection, one direction of one connection ------------------------------

_NONCE = struct.Struct(">4xQ")


class _Direction:
    """The AES-GCM key of one direction and its frame counter (one thread uses it)."""

    def __init__(self, key: bytes, mode: Mode) -> None:
        if mode is Mode.OFF:
            raise ValueError("no frame protection in mode OFF")
        self.mode = mode
        self._aead = AESGCM(key)
        self._counter = 0

    def _next(self) -> bytes:
        n = _NONCE.pack(self._counter)
        self._counter += 1
        return n

    @property
    def encrypts(self) -> bool:
        return self.mode is Mode.ENCRYPT


class Sealer(_Direction):
    """The sending end: seals headers and payload records in sending order."""

    def header(self, prefix: bytes, header: bytes) -> bytes:
        """`prefix | header' | tag`: header' is the header (AUTH) or its ciphertext."""
        if self.encrypts:
            return prefix + self._aead.encrypt(self._next(), header, prefix)
        return prefix + header + self._aead.encrypt(self._next(), b"", prefix + header)

    def record_tag(self, record: memoryview | bytes) -> bytes:
        """AUTH: the tag that follows a payload record (sent in clear)."""
        return self._aead.encrypt(self._next(), b"", record)

    def encrypt_record(self, record: memoryview | bytes, out: memoryview) -> memoryview:
        """ENCRYPT: the record's ciphertext and tag, written into `out`."""
        n = len(record) + TAG
        self._aead.encrypt_into(self._next(), record, None, out[:n])
        return out[:n]


class Opener(_Direction):
    """The receiving end: checks (and decrypts) in receiving order."""

    def header(self, prefix: memoryview, sealed: memoryview) -> bytes | memoryview:
        """The header inside `sealed` (`header' | tag`); AuthError if it was not sealed by
        the peer of this connection, for this place in the stream."""
        n = self._next()
        try:
            if self.encrypts:
                return self._aead.decrypt(n, sealed, prefix)
            body = sealed[:-TAG]
            self._aead.decrypt(n, sealed[-TAG:], bytes(prefix) + bytes(body))
            return body
        except InvalidTag:
            raise AuthError("a frame header failed authentication") from None

    def check_record(self, record: memoryview, tag: memoryview) -> None:
        """AUTH: the record's bytes are the peer's (AuthError otherwise)."""
        try:
            self._aead.decrypt(self._next(), tag, record)
        except InvalidTag:
            raise AuthError("a write's payload failed authentication") from None

    def decrypt_record(self, sealed: memoryview, out: memoryview) -> None:
        """ENCRYPT: `sealed` (ciphertext | tag) decrypted into `out` (AuthError if forged;
        `out` then holds garbage, and the write is refused)."""
        try:
            self._aead.decrypt_into(self._next(), sealed, None, out)
        except InvalidTag:
            raise AuthError("a write's payload failed authentication") from None


@dataclass(frozen=True, slots=True)
class Channel:
    """An authenticated connection's two directions, from one end's point of view."""

    peer: str
    mode: Mode
    send: Sealer
    receive: Opener


def channel(keys: Keys, mode: Mode, peer: str, *, writer: bool) -> Channel:
    out, into = (
        (keys.writer_to_reader, keys.reader_to_writer)
        if writer
        else (keys.reader_to_writer, keys.writer_to_reader)
    )
    return Channel(peer=peer, mode=mode, send=Sealer(out, mode), receive=Opener(into, mode))


def scoped(desc: RegionDescriptor, scope: str) -> RegionDescriptor:
    """A destination as writers address it under plan `scope` (its tcp key rotated)."""
    if desc.keys.tcp is None:
        return desc
    key = TcpKey(rkey=plan_rkey(desc.keys.tcp.rkey, scope))
    return msgspec.structs.replace(desc, keys=msgspec.structs.replace(desc.keys, tcp=key))


def plan_rkey(rkey: int, scope: str) -> int:
    """The key a region answers to under plan `scope` ("" = the registered key itself):
    rkeys rotate with every plan without registering anything again."""
    if not scope:
        return rkey
    digest = hashlib.blake2b(
        scope.encode(), key=rkey.to_bytes(8, "little"), person=b"ww-tcp-rkey", digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


__all__ = [
    "NONCE",
    "RECORD",
    "TAG",
    "AuthError",
    "Channel",
    "Keys",
    "Mode",
    "Opener",
    "Sealer",
    "Ticket",
    "TicketGrant",
    "TicketRefused",
    "TicketRequest",
    "Tickets",
    "channel",
    "derive",
    "plan_rkey",
    "scoped",
]
