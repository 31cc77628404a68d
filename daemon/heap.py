"""The daemon's heap around a plan. A plan and the registrations behind it are large (a
30B MoE's is about 10^6 objects) and live until the next plan; a full garbage collection
walks all of them and holds the event loop for 50-150 ms, mid-version whenever it comes.
When a plan is installed, the heap is collected once and what survives is frozen out of
the collector until the next plan: objects are still freed when their last reference
goes, and those left in cycles meanwhile (a failed run and its traceback) at the next
plan, which unfreezes everything before it collects."""

from __future__ import annotations

import gc
import time


def settle() -> float:
    """Collect everything (what was frozen before too), then freeze the survivors;
    returns the seconds it took."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0
