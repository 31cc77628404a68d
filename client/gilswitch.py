"""A shorter GIL switch interval for the whole of a GPU publish, its BeginVersion included.

Every request to the daemon hops between the calling thread and the connection's loop
thread (it reads the replies), and each hop needs the GIL: at the default 5 ms interval
any other Python-busy thread of the rank's process delays the version start by up to
that per hop (`Trainer.publish` enters this before its first request, for GPU tensors).

The rank's messages to the daemon are sent by its connection's thread (it owns the
socket), which needs the GIL; with buckets posted as soon as their packing is queued
(`Trainer(gate_copies=True)`), the publishing thread queues packing work without ever
blocking, and the connection's thread would wait up to a switch interval (5 ms by
default) for each chance to send, while the GPU, its ring full, waits for the daemon's
copies. `fast_switching()` lowers the interval for as long as any publish in the process
is inside it (counted, so that publishes on several threads restore it once, as found).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SWITCH_S = 0.0002  # well below a bucket's packing time on a GPU (0.2 ms for 256 MB)

_lock = threading.Lock()
_users = 0
_saved = 0.0


@contextlib.contextmanager
def fast_switching(on: bool = True) -> Iterator[None]:
    """Within it (with `on`), the GIL switch interval is at most `SWITCH_S`."""
    global _users, _saved
    if not on:
        yield
        return
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, SWITCH_S))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_saved)
