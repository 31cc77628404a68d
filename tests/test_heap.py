"""daemon.heap: what a plan leaves on the heap is collected once and frozen, so that a
later full collection (mid-version) does not walk it."""

from __future__ import annotations

import gc
import weakref

from weightwire.daemon import heap


def test_settle_collects_cycles_then_freezes_the_survivors() -> None:
    class Node:
        def __init__(self) -> None:
            self.other: object = self

    gc.collect()
    before = gc.get_freeze_count()
    garbage, partner = Node(), Node()
    garbage.other, partner.other = partner, garbage
    gone = weakref.ref(garbage)
    del partner
    del garbage  # a cycle: only the collector frees it
    assert gone() is not None
    kept = [[i] for i in range(10_000)]  # a plan's worth of long-lived containers
    try:
        seconds = heap.settle()
        assert seconds >= 0
        assert gc.get_freeze_count() >= before + len(kept)
        assert gone() is None  # collected, not frozen
    finally:
        gc.unfreeze()
