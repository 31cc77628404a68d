"""The data plane: this node's transports, which of them carries a write, the bring-up
signals between transport instances of two nodes (over the authenticated mesh), and fences."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import msgspec
import structlog

from weightwire.protocol.errors import PeerLostError, WeightwireError
from weightwire.protocol.peer import Member, PeerError, TransportSignal
from weightwire.protocol.regions import RegionDescriptor, TransportEndpoints
from weightwire.transport.base import Admit, ImmHandler, LocalRegion, Signal, Transport

from .seams import PeerRequest, Spawn

log = structlog.get_logger("weightwire.daemon")


class DataPlane:
    def __init__(
        self,
        node: str,
        transports: list[Transport],
        members: Mapping[str, Member],
        mesh: PeerRequest,
        spawn: Spawn,
        stall_timeout_s: float,
    ) -> None:
        self.node = node
        self.transports = transports
        self._members = members
        self._mesh = mesh
        self._spawn = spawn
        self._stall_timeout_s = stall_timeout_s

    async def start(self, on_imm: ImmHandler, admission: Admit) -> None:
        for t in self.transports:
            await t.start(on_imm)
            t.set_signal(self._signal_for(t))
            t.set_admission(admission)

    async def close(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                for t in self.transports:
                    await t.close()
        except TimeoutError:
            log.warning("transports did not close in time")

    def endpoints(self) -> TransportEndpoints:
        merged: dict[str, Any] = {}
        for t in self.transports:
            for k, v in msgspec.structs.asdict(t.endpoints()).items():
                if v is not None:
                    merged[k] = v
        return TransportEndpoints(**merged)

    def lanes(self, device_uuid: str) -> int:
        """How many paths (NICs) this node's data planes have for a rank's memory."""
        return max(t.lanes(device_uuid) for t in self.transports)

    def authorize(self, region_id: int, writers: frozenset[str], scope: str = "") -> None:
        for t in self.transports:
            t.authorize(region_id, writers, scope)

    def peer_regions(self, regions: Collection[RegionDescriptor]) -> None:
        """Every transport hears which regions of other nodes the installed plans name."""
        for t in self.transports:
            t.peer_regions(regions)

    def stats(self) -> dict[str, Any]:
        return {t.name: t.stats() for t in self.transports}

    async def transport_to(
        self, node: str, src: LocalRegion | None = None, dst: RegionDescriptor | None = None
    ) -> Transport:
        """The preferred transport that reaches `node` and carries src -> dst, connected."""
        member = self._members.get(node)
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

    def connect_soon(self, node: str) -> None:
        self._spawn(self._connect_quietly(node))

    async def _connect_quietly(self, node: str) -> None:
        with contextlib.suppress(WeightwireError):
            await self.transport_to(node)

    def disconnect_soon(self, node: str, reason: str) -> None:
        for t in self.transports:
            self._spawn(t.disconnect(node, reason))

    async def fence(self, nodes: tuple[str, ...], reason: str) -> None:
        """Stop every write of `nodes` landing here, on every transport, before a failure
        is reported (bounded: each transport's fence is)."""
        jobs = [t.fence(n, reason) for t in self.transports for n in nodes]
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        except TimeoutError:
            log.error("fence timed out", peers=list(nodes), reason=reason)
            return
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                log.error("fence failed", peers=list(nodes), error=repr(outcome))

    def _signal_for(self, transport: Transport) -> Signal:
        async def signal(node: str, payload: bytes) -> bytes:
            msg = TransportSignal(transport=transport.name, node=self.node, payload=payload)
            reply = await self._mesh.request(node, msg, self._stall_timeout_s)
            if not isinstance(reply, TransportSignal):
                raise PeerLostError(f"{node} answered a {transport.name} signal with {reply}")
            return reply.payload

        return signal

    def answer_signal_soon(self, sender: str, req: int, name: str, payload: bytes) -> None:
        self._spawn(self._answer_signal(sender, req, name, payload))

    async def _answer_signal(self, sender: str, req: int, name: str, payload: bytes) -> None:
        transport = next((t for t in self.transports if t.name == name), None)
        if transport is None:
            self._mesh.send_soon(sender, PeerError(code="invalid", message=f"no transport {name}"))
            return
        answer = await transport.on_signal(sender, payload)
        self._mesh.send_soon(
            sender,
            TransportSignal(req=req, transport=name, node=self.node, payload=answer, reply=True),
        )
