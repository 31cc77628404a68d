"""Log lines that a peer or a rank can provoke at will, at most once per interval."""

from __future__ import annotations

import time
from typing import Any


class Throttled:
    """`emit(log_method, event, **fields)` logs at most once per `interval_s`; the lines
    held back meanwhile are counted and reported (`suppressed=N`) with the next one."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self.suppressed = 0

    def emit(self, method: Any, event: str, **fields: Any) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            fields["suppressed"] = self.suppressed
            self.suppressed = 0
        method(event, **fields)
        return True
