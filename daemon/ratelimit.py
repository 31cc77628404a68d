"""Token buckets by key (a peer's node name): what any member may send in a loop, and
what each costs the daemon, answered at a bounded rate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_KEYS = 4096  # buckets kept (bounded however many names are made up)
HELLO_RATE = 1.0  # hellos a second acted on per node name (a daemon says one a second
HELLO_BURST = 5.0  # until it is welcome), by the coordinator and by every other daemon


@dataclass
class Buckets:
    rate: float  # tokens a second, per key
    burst: float  # at most this many at once
    _by: dict[str, tuple[float, float]] = field(default_factory=dict)  # tokens, when

    def take(self, key: str) -> bool:
        """One token of `key`'s bucket, if it has one (True); False: over its rate."""
        now = time.monotonic()
        tokens, then = self._by.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._by[key] = (tokens, now)
            return False
        if key not in self._by and len(self._by) >= MAX_KEYS:
            self._by.clear()
        self._by[key] = (tokens - 1.0, now)
        return True
