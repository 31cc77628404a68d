"""What the local socket (`local.py`) hands a rank's requests to, and what it tells each
rank of this daemon in `Welcome`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from weightwire.protocol.local import (
    AbortVersion,
    Applied,
    BucketReady,
    DeclareDestinations,
    DeclareSources,
    Ok,
    PlanReply,
    RegionRegistered,
    RegisterRegion,
    RemapRegion,
    TrailersReady,
    VersionComplete,
)

from .sessions import Session


class Requests(Protocol):
    """What a rank's requests are served by (ranks.py)."""

    def declare_sources(self, session: Session, msg: DeclareSources) -> None: ...

    def declare_destinations(self, session: Session, msg: DeclareDestinations) -> None: ...

    async def register(
        self, session: Session, msg: RegisterRegion, alive: Callable[[], bool]
    ) -> RegionRegistered: ...

    async def remap(self, session: Session, msg: RemapRegion) -> Ok: ...

    async def plan_for(
        self, session: Session, req: int, timeout_s: float, after_plan: str = ""
    ) -> PlanReply: ...

    async def begin_version(
        self,
        session: Session,
        req: int,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence: tuple[int, int, int] = (-1, 0, -1),
    ) -> Ok: ...

    def begin_version_now(
        self,
        session: Session,
        req: int,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence: tuple[int, int, int] = (-1, 0, -1),
        *,
        answer: Callable[[Ok], None],
    ) -> bool: ...

    def bucket_ready(self, session: Session, msg: BucketReady) -> bool:
        """True when the rank had nothing being posted: its post should start at once."""
        ...

    def trailers_ready(self, session: Session, msg: TrailersReady) -> None: ...

    def abort_version(self, session: Session, msg: AbortVersion) -> None: ...

    def applied(self, session: Session, msg: Applied) -> None: ...

    async def wait_version(
        self, session: Session, req: int, version: int, timeout_s: float
    ) -> VersionComplete: ...

    def session_gone(self, session: Session) -> None: ...


@dataclass(frozen=True)
class Identity:
    """What a rank is told in `Welcome`."""

    node: str
    incarnation: str
    version: str
    region_dir: str
