"""daemon.heap: what a plan leaves on the heap is collected once and frozen, so that a
later full collection (mid-version) does not walk it."""

from __future__ import annotations

import gc
import weakref

from weightwire.daemon import heap


class Node:
    def __init__(self) -> None:
        self.other: object = self


def test_settle_collects_cycles_then_freezes_the_survivors() -> None:
    gc.collect()
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
        assert gc.get_freeze_count() >= len(kept)
        assert gone() is None  # collected, not frozen
    finally:
        gc.unfreeze()


def test_a_cycle_frozen_alive_is_collected_at_the_next_settle() -> None:
    """A failed run and its traceback form a cycle that may be frozen while still in use;
    it must not stay frozen, uncollectable, after it becomes garbage."""
    try:
        held = [Node()]
        held[0].other = held  # alive (held here) and in a cycle when frozen
        gone = weakref.ref(held[0])
        heap.settle()
        del held
        gc.collect()
        assert gone() is not None  # frozen: the collector does not look at it
        heap.settle()
        assert gone() is None
    finally:
        gc.unfreeze()
