"""The receive side's table of registered regions: who may write into each (the writers
that the installed plans name as its sources) and the key it answers to under the current
plan (`auth.plan_rkey`). Read from receive threads; `grant` changes it from the loop.

A write into a GPU region goes in pieces through the stream's pinned bounce, each copied to
the device once it is in (`sink.py`): the region may be deregistered (its rank left, or
released its memory) between the write's lookup and its last piece, seconds later for a
large write. Such a write is counted from its lookup (`writing`) until its last copy or
its end (`done`), each copy issued only while the region is still registered as it was
looked up (`still`: else the write fails `peer_lost`), and `drained` tells the daemon
when none is left, so that it unmaps the region only then."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, replace

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.transport.base import LocalRegion
from weightwire.transport.removed import RemovedRegions, count_down, gone, unknown
from weightwire.transport.tcp.data import Write

from . import auth

GRANT_WAIT_S = 2.0  # how long a write refused by the grants waits for the plan to catch up


@dataclass(frozen=True, slots=True)
class _Registered:
    region: LocalRegion
    rkey: int  # as registered
    wire_rkey: int  # what writes must present under the current plan
    writers: frozenset[str]  # nodes that may write into it
    token: int = 0  # this registration (a remap registers the id again: another token)

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
        self._tokens = itertools.count(1)
        self._writing: dict[int, int] = {}  # GPU writes under way into each region (`writing`)

    def add(self, region: LocalRegion, rkey: int) -> None:
        with self._changed:
            token = next(self._tokens)
            self._regions[region.id] = _Registered(region, rkey, rkey, frozenset(), token)
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
            self._regions[region_id] = replace(reg, wire_rkey=wire_rkey, writers=writers)
            self._changed.notify_all()

    def lookup(self, write: Write, peer: str) -> LocalRegion:
        return self._lookup(write, peer).region

    def writing(self, write: Write, peer: str) -> tuple[LocalRegion, int]:
        """As `lookup`, and a write into a GPU region counted as under way into it until
        `done`: the region and the registration (a token) its copies must still find
        (`still`); token 0 for host memory (given whole, not counted)."""
        reg = self._lookup(write, peer, count=True)
        return reg.region, reg.token if reg.region.kind == "gpu" else 0

    def still(self, region_id: int, token: int) -> None:
        """Before a copy into a region a write is counted in: PeerLostError (`gone`) if the
        region was deregistered (or registered again) since the write's lookup. Nothing is
        unmapped while the write is counted, so a copy issued after this lands in it."""
        with self._changed:
            reg = self._regions.get(region_id)
            if reg is None or reg.token != token:
                raise gone(region_id)

    def done(self, region_id: int) -> None:
        """A write `writing` counted has no copy into the region left (landed, or failed)."""
        with self._changed:
            if count_down(self._writing, region_id):
                self._changed.notify_all()

    def drained(self, region_id: int, timeout_s: float) -> bool:
        """Whether no write is counted in `region_id` (deregistered), waiting up to
        `timeout_s` for it (0: answer at once, as on the loop)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: region_id not in self._writing, max(0.0, timeout_s)
            )

    def _lookup(self, write: Write, peer: str, count: bool = False) -> _Registered:
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
            if count and reg.region.kind == "gpu":
                self._writing[write.region] = self._writing.get(write.region, 0) + 1
        return reg

    def target(self, write: Write, peer: str, private: bool = False) -> memoryview:
        """The region's memory itself, `private` or not: a sink of tests, over memory of
        their own (the transport's is `StreamSink`)."""
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
