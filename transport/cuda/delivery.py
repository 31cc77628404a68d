"""The cuda transport's delivery path: once a batch of copies has landed, the immediates
of those that landed go to whoever owns their destination (this transport's own handler,
another cuda transport of this process on its own loop, or a daemon of this host over the
channel), and the transport's write counters move on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import structlog

from weightwire.protocol.errors import PeerLostError
from weightwire.transport.base import ImmHandler

from . import neighbours
from .channel import Channel
from .lanes import Batch

log = structlog.get_logger("weightwire.transport.cuda")


class Delivery:
    """One cuda transport's immediates, out (`landed`, `written`) and in (`receive`)."""

    def __init__(self, node: str, channel: Channel, peer_path: Callable[[str], str | None]):
        self.node = node
        self._channel = channel
        self._peer_path = peer_path  # a connected same-host node's channel path
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_imm: ImmHandler | None = None
        self._lock = threading.Lock()
        self._stats = {"bytes_sent": 0, "writes": 0, "bytes_received": 0, "batches": 0}

    def start(self, loop: asyncio.AbstractEventLoop, on_imm: ImmHandler) -> None:
        self.loop, self._on_imm = loop, on_imm

    def landed(self, batch: Batch) -> None:
        """On the loop: a batch's copies are done; deliver the immediates of those that landed."""
        chunk, failed = batch.chunk, batch.failures
        if not failed:
            nbytes, writes = chunk.nbytes, len(chunk.copies)
        else:
            landed = [c for c in chunk.copies if c.index not in failed]
            nbytes, writes = sum(c.size for c in landed), len(landed)
        with self._lock:
            self._stats["bytes_sent"] += nbytes
            self._stats["writes"] += writes
            self._stats["batches"] += 1
        imms: dict[str, list[int]] = {}
        if chunk.node and not failed:
            imms[chunk.node] = [imm for imm in batch.imms if imm is not None]
        else:
            for c, imm in zip(chunk.copies, batch.imms, strict=True):
                if imm is not None and c.index not in failed:
                    imms.setdefault(c.dst_node, []).append(imm)
        for node, values in imms.items():
            if not values:
                continue
            try:
                delivered = self.deliver(node, values)
            except Exception as exc:  # one destination's handler must not strand the rest
                log.error("immediates not delivered", peer=node, count=len(values), error=repr(exc))
                continue
            if not delivered:  # the bytes are there, the destination will never know
                lost = PeerLostError(f"node {node} went away before it was told of the write")
                for c, imm in zip(chunk.copies, batch.imms, strict=True):
                    if imm is not None and c.dst_node == node:
                        failed.setdefault(c.index, lost)

    def written(self, node: str, imms: Sequence[int]) -> bool:
        """Immediates of writes a rank made itself, in place (`Transport.deliver_written`)."""
        if not imms:
            return True
        delivered = self.deliver(node, list(imms))
        if delivered:
            with self._lock:
                self._stats["in_place_writes"] = self._stats.get("in_place_writes", 0) + len(imms)
        return delivered

    def deliver(self, node: str, imms: list[int]) -> bool:
        """Immediates of finished copies, to whichever transport owns the destination;
        False if no one is there to take them (disconnected meanwhile), or another
        daemon's channel could not take them in time (`channel.SEND_WAIT_S`)."""
        if node == self.node:
            self.receive(imms, self.node)
            return True
        owner = neighbours.get(node)
        if owner is not None:
            owner.take_imms(imms, self.node, self.loop)
            return True
        path = self._peer_path(node)
        if path is None:
            return False
        return self._channel.send_imms(path, self.node, imms)

    def take(
        self, imms: list[int], source: str, from_loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """Immediates handed over by another transport of this process (`Neighbour`)."""
        if self.loop is from_loop:
            self.receive(imms, source)
        else:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.receive, imms, source)

    def receive(self, imms: list[int], source: str) -> None:
        if self._on_imm is not None:
            for imm in imms:
                self._on_imm(imm, source)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)
