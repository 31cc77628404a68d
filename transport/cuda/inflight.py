"""Copies of this process's cuda lanes into GPU regions of this process (registered with
one of its cuda transports), counted per region from the moment they are issued until
their event has been seen: so that a region is unmapped only once nothing copies into it.

Each registration of a region is a token. A copy is resolved against one (`Copy.token`)
and is issued only while the region is still registered under it: a copy queued on a
lane when its region was deregistered (its rank left, or released its memory), or
registered again under its id (a remap, at a new address), holds a stale pointer and is
refused `peer_lost` instead. One issued before fails too once it finishes (its bytes may
have landed in memory now gone): no immediate, and its write is not reported landed.
`drained` says when the issued ones are done: the daemon unmaps the region only then (or
after a timeout; `daemon/regions.py`). Copies into another process's memory (a region of
another daemon, opened by its IPC handle) are counted too, under a key of the writer's
(`remote.py`): that daemon cannot see them, and the writer closes its mapping of the
memory only once they are done, after the plans stopped naming the region.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

from weightwire.transport.removed import count_down, gone

Key = tuple[str, int]  # (node, region id); another daemon's region: (Copy.via, id)


class Resolved(Protocol):
    """A copy as a lane issues it (`copies.Copy`)."""

    @property
    def index(self) -> int: ...

    @property
    def dst_node(self) -> str: ...

    @property
    def dst_region(self) -> int: ...

    @property
    def token(self) -> int: ...

    @property
    def key(self) -> Key: ...


class Batch(Protocol):
    """Copies issued together (`copies.Chunk`), with the distinct regions of this process
    they write into and the registration each was resolved against (cut once)."""

    @property
    def copies(self) -> Sequence[Resolved]: ...

    @property
    def regions(self) -> Sequence[tuple[Key, int]]: ...


def _gone(copies: Sequence[Resolved], keys: set[Key], failures: dict[int, BaseException]) -> None:
    for c in copies:
        if c.token and c.key in keys:
            failures.setdefault(c.index, gone(c.dst_region))


class InFlight:
    """Registrations of regions of this process, and copies issued into each."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._tokens = itertools.count(1)
        self._live: dict[Key, int] = {}  # registered regions: their token
        self._issued: dict[Key, int] = {}  # copies issued into each, not seen finished

    def register(self, key: Key) -> int:
        """A new registration of `key`: its token (copies resolved before are refused)."""
        with self._changed:
            token = self._live[key] = next(self._tokens)
        return token

    def deregister(self, key: Key) -> None:
        """No copy into `key` is issued from now on; `drained` says when the rest are done."""
        with self._changed:
            self._live.pop(key, None)

    def registered(self, key: Key, token: int) -> bool:
        with self._changed:
            return self._live.get(key) == token

    def enter(self, batch: Batch) -> tuple[list[Key], dict[int, BaseException]]:
        """Before issuing `batch`: the regions it writes into, counted as written until
        `leave`, and its copies refused (by index: their region is gone)."""
        entered: list[Key] = []
        refused: set[Key] = set()
        with self._changed:
            for key, token in batch.regions:
                if self._live.get(key) == token:
                    self._issued[key] = self._issued.get(key, 0) + 1
                    entered.append(key)
                else:
                    refused.add(key)
        failures: dict[int, BaseException] = {}
        if refused:
            _gone(batch.copies, refused, failures)
        return entered, failures

    def leave(self, entered: Iterable[Key]) -> None:
        """The copies `enter` counted have finished (their event seen) or never ran."""
        with self._changed:
            for key in entered:
                if count_down(self._issued, key):
                    self._changed.notify_all()

    def withdrawn(self, batch: Batch, failures: dict[int, BaseException]) -> None:
        """Once `batch` has finished: its copies into a region deregistered (or registered
        again) meanwhile fail, `gone`, unless they failed already."""
        if not batch.regions:
            return
        with self._changed:
            went = {key for key, token in batch.regions if self._live.get(key) != token}
        if went:
            _gone(batch.copies, went, failures)

    def issued(self, key: Key) -> int:
        """Copies issued into `key` not seen finished yet."""
        with self._changed:
            return self._issued.get(key, 0)

    def drained(self, key: Key, timeout_s: float) -> bool:
        """Whether no copy into `key` is in flight, waiting up to `timeout_s` for it (0:
        answer at once, as on the loop; blocking otherwise)."""
        with self._changed:
            return self._changed.wait_for(lambda: key not in self._issued, max(0.0, timeout_s))


REGIONS = InFlight()  # this process's: its cuda transports and their lanes share it

__all__ = ["REGIONS", "Batch", "InFlight", "Key", "Resolved"]
