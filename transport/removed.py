"""Which region ids a destination deregistered: a write to one of them is refused as its
rank lost (`peer_lost`, retryable: what a version in flight fails with when the plan is
withdrawn), not as a region that never existed (`unknown_region`). A writer still on the
plan from before an engine rank left (its regions removed with it) then fails in a way
that publishing again fixes. A `TransferError` (`PeerLostError`), as every refused write.

Daemon region ids come from a counter and are never reused, but the memory is bounded:
the last `keep` ids removed. An id registered again (a remap keeps its id) is forgotten."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError

KEEP = 4096  # ids remembered; ~100 bytes each

K = TypeVar("K", bound=Hashable)


class RemovedRegions:
    """The last `keep` region ids deregistered here (callers hold their own lock). An id
    is any hashable: a writer's view of another node's region is (node, id, handle)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._ids: OrderedDict[Hashable, None] = OrderedDict()
        self.keep = keep

    def add(self, region_id: Hashable) -> None:
        self._ids[region_id] = None
        self._ids.move_to_end(region_id)
        while len(self._ids) > self.keep:
            self._ids.popitem(last=False)

    def discard(self, region_id: Hashable) -> None:
        self._ids.pop(region_id, None)

    def __contains__(self, region_id: object) -> bool:
        return region_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def count_down(counts: dict[K, int], key: K) -> bool:
    """One fewer write in flight into `key` (its memory is unmapped only once none is):
    whether none is left (its entry then goes). Callers hold their own lock."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
        return False
    counts.pop(key, None)
    return True


def gone(region_id: int) -> PeerLostError:
    """The refusal of a write to a region deregistered here."""
    return PeerLostError(
        f"region {region_id} is gone: its rank left or released it (the plan moved; "
        "publish again on the next plan)"
    )


def unknown(region_id: int, removed: RemovedRegions, what: str = "") -> RegionError | PeerLostError:
    """The refusal of a write to a region not registered here: `gone` when it was once."""
    if region_id in removed:
        return gone(region_id)
    return RegionError(f"unknown region {region_id}{what}", code=ErrorCode.UNKNOWN_REGION)


__all__ = ["KEEP", "RemovedRegions", "count_down", "gone", "unknown"]
