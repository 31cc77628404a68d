"""The receive side's table of registered regions: who may write into each (the writers
that the installed plans name as its sources) and the key it answers to under the current
plan (`auth.plan_rkey`). Read from receive threads; `grant` changes it from the loop."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.transport.base import LocalRegion
from weightwire.transport.removed import RemovedRegions, unknown
from weightwire.transport.tcp.data import Write

from . import auth

GRANT_WAIT_S = 2.0  # how long a write refused by the grants waits for the plan to catch up


@dataclass(frozen=True, slots=True)
class _Registered:
    region: LocalRegion
    rkey: int  # as registered
    wire_rkey: int  # what writes must present under the current plan
    writers: frozenset[str]  # nodes that may write into it

    def refusal(self, write: Write, peer: str) -> RegionError | None:
        if peer not in self.writers:
            return RegionError(
                f"{peer} is not a planned source of region {write.region}",
                code=ErrorCode.UNAUTHORIZED,
            )
        if self.wire_rkey != write.rkey:
            return RegionError(
                f"wrong key for region {write.region} (from {peer})", code=ErrorCode.UNAUTHORIZED
            )
        return None


class RegionTable:
    """The receive side's view of registered regions (read from receive threads). A region
    takes writes from nobody until `grant` names its writers."""

    def __init__(self, grant_wait_s: float = GRANT_WAIT_S) -> None:
        self._regions: dict[int, _Registered] = {}
        self.removed = RemovedRegions()  # a write to one: peer_lost, not unknown_region
        self._changed = threading.Condition()
        self.grant_wait_s = grant_wait_s

    def add(self, region: LocalRegion, rkey: int) -> None:
        with self._changed:
            self._regions[region.id] = _Registered(region, rkey, rkey, frozenset())
            self.removed.discard(region.id)
            self._changed.notify_all()

    def remove(self, region_id: int) -> None:
        with self._changed:
            if self._regions.pop(region_id, None) is not None:
                self.removed.add(region_id)
            self._changed.notify_all()

    def grant(self, region_id: int, writers: frozenset[str], scope: str) -> None:
        with self._changed:
            reg = self._regions.get(region_id)
            if reg is None:
                return
            wire_rkey = auth.plan_rkey(reg.rkey, scope)
            self._regions[region_id] = _Registered(reg.region, reg.rkey, wire_rkey, writers)
            self._changed.notify_all()

    def lookup(self, write: Write, peer: str) -> LocalRegion:
        """The region a write may land in; RegionError (the connection closes) otherwise.

        A write that the grants refuse waits up to `grant_wait_s` for them to change: a
        writer may hold a new plan a moment before this node has installed it."""
        deadline: float | None = None
        with self._changed:
            while True:
                reg = self._regions.get(write.region)
                if reg is None:  # peer_lost when its rank left (removed): retryable
                    raise unknown(write.region, self.removed)
                problem = reg.refusal(write, peer)
                if problem is None:
                    break
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.grant_wait_s
                if now >= deadline:
                    raise problem
                self._changed.wait(deadline - now)
        reg.region.check(write.offset, write.length, "write")
        return reg.region

    def target(self, write: Write, peer: str) -> memoryview:
        return self.host_view(self.lookup(write, peer), write)

    @staticmethod
    def host_view(region: LocalRegion, write: Write) -> memoryview:
        """The bytes of `region` (looked up for `write`) that the write lands in."""
        if region.view is None:
            raise RegionError(f"region {write.region} is not host memory")
        return region.view[write.offset : write.offset + write.length]

    def piece(self, write: Write, done: int) -> memoryview:
        """Never asked for: `target` gives a write's host memory whole."""
        raise RegionError(f"region {write.region}: a write's host memory is given whole")

    def landed(self, write: Write) -> None:
        pass


__all__ = ["GRANT_WAIT_S", "RegionTable"]
