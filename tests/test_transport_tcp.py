"""The conformance suite on the tcp transport (host memory, loopback), in each of its
security modes: unauthenticated, authenticated (the default) and encrypted. Tickets go
between the two transports the way the daemons' control channel carries them."""

from __future__ import annotations

import msgspec
import pytest

from tests.conformance.harness import Pair, Pausable, TransportKit
from tests.conformance.proxy import PausableRelay
from tests.conformance.suite import *  # noqa: F403
from weightwire.memory.hostmem import SharedFile, create_shared
from weightwire.protocol.regions import TransportEndpoints
from weightwire.transport.base import LocalRegion, Transport, WriteRequest
from weightwire.transport.tcp import TcpTransport


class TcpKit(TransportKit):
    name = "tcp"

    def __init__(self, security: str = "auth", bounce_bytes: int = 64 << 20) -> None:
        self.security = security
        self.bounce_bytes = bounce_bytes  # pinned memory per stream for GPU regions
        self._files: dict[int, SharedFile] = {}
        self.nodes: dict[str, TcpTransport] = {}

    def make(self, node: str) -> Transport:
        t = TcpTransport(
            node, bind_host="127.0.0.1", streams=3, stall_timeout_s=10, security=self.security,
            bounce_bytes=self.bounce_bytes,
        )  # fmt: skip
        self.nodes[node] = t

        async def signal(peer: str, payload: bytes) -> bytes:
            return await self.nodes[peer].on_signal(node, payload)

        t.set_signal(signal)
        return t

    def region(self, region_id: int, length: int) -> LocalRegion:
        f = create_shared(length, purpose="test")
        f.unlink()
        self._files[id(f.view)] = f
        return LocalRegion(id=region_id, kind="cpu", length=length, view=f.view, fd=f.fd)

    async def pausable(self, pair: Pair) -> Pausable | None:
        ep = pair.b.transport.endpoints().tcp
        assert ep is not None
        relay = PausableRelay(ep.host, ep.port)
        await relay.start()
        await pair.a.transport.disconnect("node-b", "writing through a relay")
        via = msgspec.structs.replace(ep, host="127.0.0.1", port=relay.port)
        await pair.a.transport.connect("node-b", TransportEndpoints(tcp=via))
        return relay


@pytest.fixture(params=["auth", "encrypt", "off"])
def kit(request: pytest.FixtureRequest) -> TransportKit:
    return TcpKit(request.param)


def test_the_stronger_setting_of_two_nodes_wins_and_plain_hellos_are_refused() -> None:
    """An `auth` writer and an `encrypt` reader agree on encryption; a writer that runs
    unauthenticated (no control channel) gets its first write refused, unauthorized."""
    import asyncio

    from weightwire.protocol.errors import WeightwireError
    from weightwire.protocol.regions import RegionDescriptor

    async def body() -> None:
        kit = TcpKit()
        a = TcpTransport("a", bind_host="127.0.0.1", security="auth")
        b = TcpTransport("b", bind_host="127.0.0.1", security="encrypt")
        plain = TcpTransport("p", bind_host="127.0.0.1", security="off")
        nodes = {"a": a, "b": b}
        for name, t in nodes.items():

            async def signal(peer: str, payload: bytes, me: str = name) -> bytes:
                return await nodes[peer].on_signal(me, payload)

            t.set_signal(signal)
        for t in (a, b, plain):
            await t.start(lambda imm, src: None)
        try:
            src, dst = kit.region(1, 4096), kit.region(2, 4096)
            kit.fill(src, 0, bytes(range(256)) * 16)
            keys = b.register(dst)
            b.authorize(2, frozenset({"a", "p"}))
            desc = RegionDescriptor(id=2, node="b", kind="cpu", length=4096, keys=keys)
            await a.connect("b", b.endpoints())
            await a.write(WriteRequest(src, 0, desc, 0, 4096, 1))
            assert kit.read(dst, 0, 4096) == bytes(range(256)) * 16
            assert all(s.channel and s.channel.mode.name == "ENCRYPT" for s in a._peers["b"])
            kit.fill(dst, 0, bytes(4096))
            await plain.connect("b", b.endpoints())
            try:
                await plain.write(WriteRequest(src, 0, desc, 0, 4096, 1))
            except WeightwireError as exc:  # the refusal itself, or the stream it closed
                assert "unauthorized" in str(exc), exc
            else:
                raise AssertionError("an unauthenticated write was accepted")
            assert kit.read(dst, 0, 4096) == bytes(4096)
        finally:
            for t in (a, b, plain):
                await t.close()

    asyncio.run(asyncio.wait_for(body(), 60))
