"""The conformance suite on the tcp transport (host memory, loopback)."""

from __future__ import annotations

import msgspec
import pytest

from tests.conformance.harness import Pair, Pausable, TransportKit
from tests.conformance.proxy import PausableRelay
from tests.conformance.suite import *  # noqa: F403
from weightwire.memory.hostmem import SharedFile, create_shared
from weightwire.protocol.regions import TransportEndpoints
from weightwire.transport.base import LocalRegion, Transport
from weightwire.transport.tcp import TcpTransport


class TcpKit(TransportKit):
    name = "tcp"

    def __init__(self) -> None:
        self._files: dict[int, SharedFile] = {}

    def make(self, node: str) -> Transport:
        return TcpTransport(node, bind_host="127.0.0.1", streams=3, stall_timeout_s=10)

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

    def read(self, region: LocalRegion, offset: int, length: int) -> bytes:
        assert region.view is not None
        return bytes(region.view[offset : offset + length])

    def fill(self, region: LocalRegion, offset: int, data: bytes) -> None:
        assert region.view is not None
        region.view[offset : offset + len(data)] = data


@pytest.fixture
def kit() -> TransportKit:
    return TcpKit()
