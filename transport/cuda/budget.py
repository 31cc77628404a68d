"""A lane's budget of driver operations in flight, taken and given back in any amounts.
The lane takes it for its batches in their order, so nothing here waits or queues."""

from __future__ import annotations


class OpBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def cost(self, ops: int) -> int:
        """What taking `ops` costs: at most the whole budget."""
        return max(1, min(ops, self.limit))

    def try_take(self, ops: int) -> int:
        """Takes `ops` (capped at the limit) if they fit now; returns what was taken, or 0."""
        n = self.cost(ops)
        if self.used + n > self.limit:
            return 0
        self.used += n
        self.peak = max(self.peak, self.used)
        return n

    def give(self, n: int) -> None:
        self.used -= n
