"""What a transport must provide to be run against the conformance suite."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, Transport

T = TypeVar("T")


class Pausable(Protocol):
    """Something between a writer and its destination that can stop the writer's bytes."""

    def pause(self, after: int = 0) -> None: ...

    def resume(self) -> None: ...

    async def close(self) -> None: ...


class TransportKit(abc.ABC):
    """Makes transports and memory of the kind a transport moves (host, GPU, ...)."""

    name: str
    precise_codes = True  # refusals carry the exact ErrorCode (tcp), not only TransferError
    admits_before_landing = True  # set_admission's check runs before a write lands (not verbs)

    async def pausable(self, pair: Pair) -> Pausable | None:
        """Route a -> b through something that can hold a's bytes back mid-write (a writer
        stopped with SIGSTOP, as b sees it); None: this kit cannot (writes are then posted
        just before the fence instead)."""
        return None

    @abc.abstractmethod
    def make(self, node: str) -> Transport: ...

    @abc.abstractmethod
    def region(self, region_id: int, length: int) -> LocalRegion: ...

    def read(self, region: LocalRegion, offset: int, length: int) -> bytes:
        """The region's bytes; this default reads a host region through its view."""
        assert region.view is not None
        return bytes(region.view[offset : offset + length])

    def fill(self, region: LocalRegion, offset: int, data: bytes) -> None:
        """Writes `data` into the region; this default through a host region's view."""
        assert region.view is not None
        region.view[offset : offset + len(data)] = data

    def release(self, region: LocalRegion) -> None:  # noqa: B027 - optional
        pass


@dataclass
class Node:
    name: str
    transport: Transport
    imms: list[tuple[int, str]] = field(default_factory=list)
    on_imm_check: Callable[[int, str], None] | None = None

    def handler(self, imm: int, source: str) -> None:
        if self.on_imm_check is not None:
            self.on_imm_check(imm, source)
        self.imms.append((imm, source))


@dataclass
class Pair:
    kit: TransportKit
    a: Node
    b: Node
    regions: list[LocalRegion] = field(default_factory=list)

    def region(
        self, node: Node, region_id: int, length: int
    ) -> tuple[LocalRegion, RegionDescriptor]:
        region = self.kit.region(region_id, length)
        self.regions.append(region)
        keys = node.transport.register(region)
        node.transport.authorize(region_id, frozenset({self.a.name, self.b.name}))
        desc = RegionDescriptor(
            id=region_id, node=node.name, kind=region.kind, length=length, keys=keys
        )
        return region, desc


async def with_pair(kit: TransportKit, body: Callable[[Pair], Awaitable[T]]) -> T:
    a = Node("node-a", kit.make("node-a"))
    b = Node("node-b", kit.make("node-b"))
    await a.transport.start(a.handler)
    await b.transport.start(b.handler)
    pair = Pair(kit, a, b)
    try:
        await asyncio.wait_for(a.transport.connect("node-b", b.transport.endpoints()), 20)
        await asyncio.wait_for(b.transport.connect("node-a", a.transport.endpoints()), 20)
        return await body(pair)
    finally:
        await a.transport.close()
        await b.transport.close()
        for r in pair.regions:
            kit.release(r)
