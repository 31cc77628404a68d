"""The records the parts of the verbs transport share: writes, outgoing queue pairs and the
links that hold them, incoming queue pairs, peers. Plain state, no verbs calls.

A work request's id carries its queue pair's generation (`wr_id = gen << ID_BITS | write
id`): a rebuilt queue pair starts a new generation, so completions flushed from the old
one are recognised and dropped.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from weightwire.protocol.regions import TransportEndpoints

from . import wire
from .hw import OpenDevice

READY, BROKEN, DEAD = "ready", "broken", "dead"
ID_BITS = 40  # wr_id = generation << 40 | write id
ID_MASK = (1 << ID_BITS) - 1


def new_psn() -> int:
    """A random 24-bit packet sequence number for a queue pair's (re)start."""
    return secrets.randbits(24)


@dataclass(eq=False)
class Write:
    id: int
    future: asyncio.Future[None]
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int  # of one block
    imm: int | None
    wrs_left: int
    offset: int = 0  # bytes posted so far, over all blocks
    count: int = 1  # blocks of `length` bytes (a strided write)
    src_stride: int = 0
    dst_stride: int = 0


@dataclass(eq=False)
class Qp:
    """One outgoing RC queue pair of a link, with its send-queue accounting."""

    link: Link
    index: int
    qp: Any
    qpn: int
    psn: int
    depth: int  # max_send_wr
    wrs: list[Any]  # wr_per_post SendWRs chained once: a post of k uses the last k
    sges: list[Any]
    state: str = READY
    gen: int = 1
    used: int = 0  # send-queue slots held (posted, not yet freed by a signaled completion)
    run: int = 0  # WRs posted since the last signaled one
    credits: int = 0  # WRITE_WITH_IMMs the peer has receives for
    signaled: deque[tuple[int, int, Write | None]] = field(default_factory=deque)
    queue: deque[Write] = field(default_factory=deque)
    inflight: dict[int, Write] = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def dev(self) -> OpenDevice:
        return self.link.dev

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.inflight)


@dataclass(eq=False)
class Link:
    """Outgoing queue pairs from one local device to one device of a peer."""

    id: int
    peer: str
    dev: OpenDevice
    dst_device: str
    up: asyncio.Future[None]
    chunk: int = 0
    remote: wire.Path | None = None
    qps: list[Qp] = field(default_factory=list)
    dead: str = ""

    def pick(self) -> Qp:
        ready = [q for q in self.qps if q.state == READY] or self.qps
        return min(ready, key=lambda q: q.load)


@dataclass(eq=False)
class InQp:
    """One incoming RC queue pair: receives kept posted for WRITE_WITH_IMM."""

    node: str
    dev: OpenDevice
    qp: Any
    qpn: int
    psn: int
    recv: Any  # one RecvWR, reposted
    depth: int  # receives kept posted
    state: str = READY
    gen: int = 1


@dataclass(eq=False)
class InLink:
    src: wire.Path
    qps: list[InQp] = field(default_factory=list)


CheckKey = tuple[int, str, int, int, int]
"""What a descriptor check covers: (region, device, addr, rkey, length)."""


@dataclass(eq=False)
class Peer:
    node: str
    endpoints: TransportEndpoints
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    valid: set[CheckKey] = field(default_factory=set)
    checking: dict[CheckKey, asyncio.Task[None]] = field(default_factory=dict)
