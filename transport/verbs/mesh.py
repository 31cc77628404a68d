"""Bring-up requests to a peer's verbs transport, carried by the daemons' authenticated
mesh (`Signal`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from weightwire.protocol.errors import (
    PeerLostError,
    ProtocolError,
    TransferError,
    WeightwireError,
    error_from_code,
)
from weightwire.transport.base import Signal

from . import wire

Local = Callable[[str, bytes], Awaitable[bytes]]
"""This node's own handler of bring-up requests (`on_signal`), for writes to itself."""


class Mesh:
    def __init__(self, node: str, local: Local, timeout_s: float) -> None:
        self.node = node
        self.local = local
        self.timeout_s = timeout_s
        self.signal: Signal | None = None

    async def ask(self, node: str, msg: wire.Request) -> wire.Reply:
        """One bring-up request to `node`'s verbs transport, with a timeout; refusals
        become the TransferError subclass of their code."""
        payload = wire.encode(msg)
        try:
            if node == self.node:
                data = await self.local(self.node, payload)
            elif self.signal is None:
                raise PeerLostError(f"no signal channel to {node} (set_signal was not called)")
            else:
                data = await asyncio.wait_for(self.signal(node, payload), self.timeout_s)
        except TimeoutError:
            raise PeerLostError(
                f"{node} did not answer a verbs {type(msg).__name__.lower()} in "
                f"{self.timeout_s:.0f} s"
            ) from None
        except PeerLostError:
            raise
        except WeightwireError as exc:
            raise PeerLostError(f"{node}: {exc.message}") from None
        except (OSError, RuntimeError) as exc:
            raise PeerLostError(f"{node}: {exc}") from None
        try:
            reply = wire.decode_reply(data)
        except ProtocolError as exc:
            raise TransferError(
                f"{node} answered a verbs request with garbage: {exc.message}"
            ) from None
        if isinstance(reply, wire.Refused):
            err = error_from_code(reply.code, f"{node}: {reply.message}")
            if not isinstance(err, TransferError):
                err = TransferError(err.message, code=err.code)
            raise err
        return reply
