"""The answer to StatusQuery (`weightwire status --cluster`), bounded: any member may send
them in a loop, and each used to cost a status document made afresh and sent back.

Each asking node has a token bucket (`RATE` a second, `BURST` at once; a cluster status
asks each node once); a query past it is dropped, with one log line a while, and its asker
times out as with a daemon that is down. A document is made at most once per `FRESH_S`
and shared by the answers in that time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .lograte import Throttled
from .ratelimit import Buckets

log = structlog.get_logger("weightwire.daemon")

RATE = 5.0  # answers a second to one node
BURST = 10.0
FRESH_S = 0.25  # a document this young is answered again as it is


@dataclass
class StatusAnswers:
    make: Callable[[], dict[str, Any]]
    _buckets: Buckets = field(default_factory=lambda: Buckets(RATE, BURST))
    _doc: dict[str, Any] | None = None
    _made: float = -float("inf")
    _dropped: Throttled = field(default_factory=lambda: Throttled(10.0))
    made: int = 0  # documents made (for tests and status)
    dropped: int = 0

    def answer(self, node: str) -> dict[str, Any] | None:
        """The document to answer `node` with, or None: drop its query."""
        if not self._buckets.take(node):
            self.dropped += 1
            self._dropped.emit(
                log.warning,
                "status queries dropped",
                peer=node,
                rate_per_s=RATE,
                dropped_total=self.dropped,
            )
            return None
        now = time.monotonic()
        if self._doc is None or now - self._made > FRESH_S:
            self._doc, self._made = self.make(), now
            self.made += 1
        return self._doc
