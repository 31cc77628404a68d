"""Dialing a peer over tcp: the ticket its destination issues (over the control channel,
or this node's own when the peer is itself) and each outgoing stream, connected and
handshaken within the connect timeout."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from weightwire.protocol.errors import PeerLostError, TimeoutError_, error_from_code
from weightwire.protocol.regions import TcpEndpoint
from weightwire.transport.base import Signal

from . import auth, handshake
from .bounce import DEFAULT_CAP, Pinned
from .streams import OutgoingStream, tune


async def ticket(
    me: str,
    node: str,
    mode: auth.Mode,
    grant: Signal,
    signal: Signal | None,
    connect_timeout_s: float,
) -> auth.TicketGrant | None:
    """A ticket for connections to `node` (None: both ends run unauthenticated). `grant`:
    this node's own issuer (`TcpTransport.on_signal`); `signal`: the control channel."""
    payload = auth.encode(auth.TicketRequest(mode=int(mode)))
    if node == me:
        answer = await grant(node, payload)
    elif signal is None:
        if mode is auth.Mode.OFF:
            return None
        raise auth.AuthError(
            f"tcp security {mode.name.lower()} needs the control channel to {node} "
            "(set_signal was not called)"
        )
    else:
        try:
            answer = await asyncio.wait_for(signal(node, payload), connect_timeout_s)
        except TimeoutError:
            raise TimeoutError_(f"{node} issued no tcp ticket in time") from None
    reply = auth.decode_reply(answer)
    if isinstance(reply, auth.TicketRefused):
        raise error_from_code(reply.code, f"{node} refused a tcp ticket: {reply.message}")
    return reply if reply.mode != auth.Mode.OFF else None


async def open_stream(
    loop: asyncio.AbstractEventLoop | None,
    me: str,
    node: str,
    ep: TcpEndpoint,
    ticket: auth.TicketGrant | None,
    connect_timeout_s: float,
    stall_timeout_s: float,
    count_sent: Callable[[int], None],
    bounce_bytes: int = DEFAULT_CAP,
    pinned: Pinned | None = None,
) -> OutgoingStream:
    """One outgoing stream from `me` to `node`, started; it reports the bytes it sends to
    `count_sent`, and GPU sources go through at most `bounce_bytes` of pinned memory."""
    assert loop is not None
    infos = await loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, addr), connect_timeout_s)
    except TimeoutError:
        sock.close()
        raise TimeoutError_(
            f"tcp connect to {node} at {ep.host}:{ep.port} timed out after "
            f"{connect_timeout_s:.0f} s"
        ) from None
    except OSError as exc:
        sock.close()
        raise PeerLostError(f"tcp connect to {node} at {ep.host}:{ep.port}: {exc}") from None
    try:
        channel = await asyncio.wait_for(
            handshake.connect(loop, sock, me, node, ticket),
            connect_timeout_s,
        )
    except TimeoutError:
        sock.close()
        raise TimeoutError_(f"tcp handshake with {node} timed out") from None
    except OSError as exc:
        sock.close()
        raise PeerLostError(f"tcp handshake with {node}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    tune(sock, stall_timeout_s)
    stream = OutgoingStream(
        node, sock, loop, stall_timeout_s, count_sent,
        channel=channel, bounce_bytes=bounce_bytes, pinned=pinned,
    )  # fmt: skip
    stream.start()
    return stream
