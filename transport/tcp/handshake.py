"""The handshake of an authenticated tcp data connection (auth.py has the keys and the
frame protection): tickets granted over the control channel, the writer's end
(`connect`) and the reader's end (`Acceptor`, driven by wire.ReceiveMachine).

    writer -> DataHello(node, ticket id, writer nonce)
    reader -> Challenge(reader nonce, mode, reader proof)
    writer -> Proof(writer proof)
"""

from __future__ import annotations

import asyncio
import socket

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import PeerLostError, WeightwireError, error_from_code
from weightwire.transport.tcp.data import PREFIX, Challenge, DataHello, DataMessage, Proof, Refused

from . import wire
from .auth import (
    AuthError,
    Channel,
    Keys,
    Mode,
    Ticket,
    TicketGrant,
    TicketRefused,
    Tickets,
    channel,
    decode_request,
    derive,
    encode,
    nonce,
    same,
)


def grant(tickets: Tickets, mine: Mode, node: str, payload: bytes) -> bytes:
    """The reader's answer to a ticket request from `node` (as the control channel
    authenticated it): a ticket for the stronger of both settings, or none if both are off."""
    try:
        req = decode_request(payload)
        mode = max(mine, Mode.parse(req.mode))
    except WeightwireError as exc:
        return encode(TicketRefused(code=exc.code.value, message=exc.message))
    if mode is Mode.OFF:
        return encode(TicketGrant(ticket=b"", secret=b"", mode=int(mode)))
    ticket = tickets.issue(node, mode)
    return encode(TicketGrant(ticket=ticket.id, secret=ticket.secret, mode=int(ticket.mode)))


async def connect(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    me: str,
    node: str,
    ticket: TicketGrant | None,
) -> Channel | None:
    """The writer's end, on a connected non-blocking socket (None: unauthenticated)."""
    mine = nonce()
    hello = DataHello(
        protocol=PROTOCOL_VERSION,
        node=me,
        ticket=ticket.ticket if ticket else b"",
        nonce=mine if ticket else b"",
    )
    await loop.sock_sendall(sock, wire.encode(hello))
    if ticket is None:
        return None
    answer = await _read_frame(loop, sock)
    if isinstance(answer, Refused):
        raise error_from_code(answer.code, f"{node} refused the connection: {answer.message}")
    if not isinstance(answer, Challenge):
        raise AuthError(f"{node} answered the hello with {type(answer).__name__}")
    mode = Mode.parse(answer.mode)
    keys = derive(ticket.ticket, ticket.secret, me, node, mine, answer.nonce, mode)
    if mode != ticket.mode or not same(answer.proof, keys.reader_proof):
        raise AuthError(f"{node}'s data port failed to prove its identity")
    await loop.sock_sendall(sock, wire.encode(Proof(proof=keys.writer_proof)))
    return channel(keys, mode, node, writer=True)


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> DataMessage:
    kind, hlen = wire.decode_prefix(await _read_exactly(loop, sock, PREFIX.size))
    return wire.decode_header(kind, await _read_exactly(loop, sock, hlen))


async def _read_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(sock, n - len(data))
        if not chunk:
            raise PeerLostError("connection closed during the handshake")
        data += chunk
    return data


class Acceptor:
    """The reader's end of one connection's handshake."""

    def __init__(self, node: str, mode: Mode, tickets: Tickets | None) -> None:
        self.node = node
        self.mode = mode
        self.tickets = tickets
        self._pending: tuple[Ticket, Keys, Mode] | None = None

    def hello(self, hello: DataHello) -> Challenge | None:
        """The challenge to send, or None when the hello is accepted as it is (both ends
        unauthenticated). AuthError when the connection may not go on."""
        if not hello.ticket:
            if self.mode is Mode.OFF:
                return None
            raise AuthError(
                f"{self.node} accepts only authenticated data connections; "
                f"{hello.node!r} presented no ticket"
            )
        if self.tickets is None:
            raise AuthError(f"{self.node} issues no tickets")
        ticket = self.tickets.redeem(hello.ticket, hello.node)
        mine = nonce()
        keys = derive(
            ticket.id, ticket.secret, hello.node, self.node, hello.nonce, mine, ticket.mode
        )
        self._pending = (ticket, keys, ticket.mode)
        return Challenge(nonce=mine, mode=int(ticket.mode), proof=keys.reader_proof)

    def proof(self, proof: Proof) -> Channel:
        if self._pending is None:
            raise AuthError("a proof nobody asked for")
        ticket, keys, mode = self._pending
        self._pending = None
        if not same(proof.proof, keys.writer_proof):
            raise AuthError(f"data connection claiming to be {ticket.node!r} failed its proof")
        return channel(keys, mode, ticket.node, writer=False)


__all__ = ["Acceptor", "connect", "grant"]
