"""The data plane's wiring: which transport carries a write, and the bring-up signals
between transport instances of two nodes (over the authenticated mesh)."""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

from weightwire.protocol.errors import PeerLostError, WeightwireError
from weightwire.protocol.peer import (
    PeerError,
    TransportSignal,
)
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, Transport

log = structlog.get_logger("weightwire.daemon")


class DataPlane:
    """Transport choice and signals (mixed into Daemon)."""

    async def transport_to(
        self, node: str, src: LocalRegion | None = None, dst: RegionDescriptor | None = None
    ) -> Transport:
        """The preferred transport that reaches `node` and carries src -> dst, connected."""
        member = self.members.get(node)
        if member is None:
            raise PeerLostError(f"node {node} is not a member of the cluster")
        for t in self.transports:
            if not t.can_reach(member.transports):
                continue
            if src is not None and dst is not None and not t.accepts(src, dst):
                continue
            await t.connect(node, member.transports)
            return t
        raise PeerLostError(f"no transport of {self.node} reaches {node} for this write")

    async def _connect_quietly(self, node: str) -> None:
        with contextlib.suppress(WeightwireError):
            await self.transport_to(node)

    def _signal_for(self, transport: Transport) -> Any:
        async def signal(node: str, payload: bytes) -> bytes:
            msg = TransportSignal(transport=transport.name, node=self.node, payload=payload)
            reply = await self.mesh.request(node, msg, self.cfg.stall_timeout_s)
            if not isinstance(reply, TransportSignal):
                raise PeerLostError(f"{node} answered a {transport.name} signal with {reply}")
            return reply.payload

        return signal

    async def _answer_signal(self, sender: str, req: int, name: str, payload: bytes) -> None:
        transport = next((t for t in self.transports if t.name == name), None)
        if transport is None:
            self.mesh.send_soon(sender, PeerError(code="invalid", message=f"no transport {name}"))
            return
        answer = await transport.on_signal(sender, payload)
        self.mesh.send_soon(
            sender,
            TransportSignal(req=req, transport=name, node=self.node, payload=answer, reply=True),
        )
