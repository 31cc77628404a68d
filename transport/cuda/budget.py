"""A lane's budget of driver operations in flight, taken and given back in any amounts,
first come first served."""

from __future__ import annotations

import asyncio
from collections import deque


class OpBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def cost(self, ops: int) -> int:
        """What taking `ops` costs: at most the whole budget."""
        return max(1, min(ops, self.limit))

    async def take(self, ops: int) -> int:
        """Waits until `ops` (capped at the limit) fit; returns what was taken."""
        n = self.cost(ops)
        if not self._waiters and self.used + n <= self.limit:
            self._grant(n)
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give(n)  # granted just as we were cancelled
            else:
                fut.cancel()
                self._wake()
            raise
        return n

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _grant(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.limit:
                return
            self._waiters.popleft()
            self._grant(n)
            fut.set_result(None)
