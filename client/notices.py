"""What an engine rank hears of its versions from its daemon: a version landed or failed
(`latest`, the `on_version` callbacks), and, with a delta area, the buckets and versions to
apply (each version answered with `Applied`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from weightwire.protocol.errors import ErrorCode, error_from_code
from weightwire.protocol.local import (
    Applied,
    ApplyBucket,
    ApplyVersion,
    LocalMessage,
    VersionComplete,
    VersionFailed,
)

from .delta.receiver import DeltaReceiver


@dataclass(frozen=True)
class VersionInfo:
    version: int
    nbytes: int
    seconds: float


Callback = Callable[[VersionInfo | Exception], None]
log = structlog.get_logger("weightwire.client.engine")


class VersionNotices:
    """An engine rank's notifications: `notify` takes each, on the connection's delivery
    thread. `delta()` gives the rank's delta area now (None: none), `send` answers."""

    def __init__(
        self,
        rank: int,
        delta: Callable[[], DeltaReceiver | None],
        send: Callable[[Applied], None],
    ) -> None:
        self.rank, self._delta, self._send = rank, delta, send
        self.callbacks: list[Callback] = []
        self.latest: VersionInfo | None = None
        self._cond = threading.Condition()

    def notify(self, msg: LocalMessage) -> None:
        event: VersionInfo | Exception
        match msg:
            case VersionComplete(rank=rank) if rank == self.rank:
                event = VersionInfo(msg.version, msg.nbytes, msg.seconds)
                with self._cond:
                    self.latest = event
                    self._cond.notify_all()
            case VersionFailed(rank=rank) if rank == self.rank:
                event = error_from_code(msg.code, f"version {msg.version}: {msg.message}")
            case ApplyBucket(rank=rank) if rank == self.rank:
                delta = self._delta()
                if delta is not None and msg.region == delta.region:
                    delta.apply_bucket(msg)  # no reply: ApplyVersion settles it
                return
            case ApplyVersion(rank=rank) if rank == self.rank:
                delta = self._delta()
                if delta is None or msg.region != delta.region:
                    reply = Applied(
                        rank=self.rank,
                        version=msg.version,
                        ok=False,
                        code=ErrorCode.INVALID.value,
                        message=f"engine rank {self.rank} has no delta area {msg.region}",
                    )
                else:
                    reply = delta.apply(msg)
                self._send(reply)
                return
            case _:
                return
        for cb in self.callbacks:
            try:
                cb(event)
            except Exception:  # the caller's bug: the other callbacks, and later events, go on
                log.exception(
                    "an on_version callback failed", callback=repr(cb), outcome=repr(event)
                )
