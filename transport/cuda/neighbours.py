"""The cuda transports of this process, by node. A write from one to another needs no
channel: the writer finds the destination's region, asks its admission, hands it the
immediates and fences its own lanes for it through `Neighbour`, and no transport reaches
into another's state."""

from __future__ import annotations

import asyncio
from typing import Protocol

from weightwire.protocol.errors import PeerLostError, RegionError

from .regions import Local


class Neighbour(Protocol):
    """What a cuda transport of this process answers another one."""

    def region(self, region_id: int) -> Local | None:
        """Its registered region `region_id`, if any."""
        ...

    def missing(self, region_id: int) -> RegionError | PeerLostError:
        """Why a write into its region `region_id`, not registered, is refused: peer_lost
        when it was deregistered (its rank left or released it), else unknown_region."""
        ...

    def admits(self, source: str, imm: int) -> bool:
        """Whether a write from `source` tagged `imm` is admitted (its version not failed)."""
        ...

    def take_imms(
        self, imms: list[int], source: str, from_loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """Immediates of writes from `source` that landed, handed over from `from_loop`:
        delivered at once on its own loop, else scheduled there."""
        ...

    def peer_gone(self, node: str) -> None:
        """The transport of `node` closed."""
        ...

    async def fence_writes(
        self, to_node: str, err: BaseException, from_loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """Its queued copies into `to_node`'s memory fail with `err`, those issued are waited
        for (on its own loop; awaited from `from_loop`). Nothing when it was never started."""
        ...


_INSTANCES: dict[str, Neighbour] = {}  # transports of this process, by node


def add(node: str, transport: Neighbour) -> None:
    _INSTANCES[node] = transport


def remove(node: str) -> None:
    _INSTANCES.pop(node, None)


def get(node: str) -> Neighbour | None:
    return _INSTANCES.get(node)
