"""The narrow seams the daemon's services are given at construction (node.py wires them).

Each service owns its state and sees the others only through one of these: what it may ask,
nothing more. None of them imports another service.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.local import LocalMsg
from weightwire.protocol.peer import PeerMessage, PeerMsg
from weightwire.protocol.plan import NodePlan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, Transport


class PeerSend(Protocol):
    """The peer mesh, for fire-and-forget messages to another node."""

    def send_soon(self, node: str, msg: PeerMsg) -> None: ...


class PeerRequest(PeerSend, Protocol):
    """The peer mesh, for a request answered by the peer (transport signals)."""

    async def request(self, node: str, msg: PeerMsg, timeout_s: float) -> PeerMessage: ...


class RankLink(Protocol):
    """The local socket, outward: a message to one session, or to every session of a rank."""

    def send(self, identity: bytes, msg: LocalMsg) -> None: ...

    def push(self, job: str, role: str, rank: int, msg: LocalMsg) -> None: ...


class Spawn(Protocol):
    """Run a background task owned (and cancelled at shutdown) by the composition root."""

    def __call__(self, coro: Coroutine[Any, Any, None]) -> None: ...


class PickTransport(Protocol):
    """A connected transport to `node` that carries src -> dst."""

    async def __call__(
        self, node: str, src: LocalRegion | None = None, dst: RegionDescriptor | None = None
    ) -> Transport: ...


class PlanUser(Protocol):
    """Told when a job's plan changes (installed, or withdrawn: `plan` None)."""

    def use_plan(self, job: str, plan: NodePlan | None, reason: str = "") -> None: ...

    def plan_problem(self, job: str, err: WeightwireError) -> None:
        """The coordinator cannot plan the job: its plan is gone, for that reason."""


class Authorize(Protocol):
    """Receive side: only `writers` may write into region `region_id` (with its key for
    plan `scope`), on every transport."""

    def __call__(self, region_id: int, writers: frozenset[str], scope: str = "") -> None: ...


class Joining(Protocol):
    """Where this node stands with the coordinator (for messages and errors)."""

    @property
    def coordinator_name(self) -> str | None: ...

    def waiting_for(self, job: str) -> str: ...
