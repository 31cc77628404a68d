"""The local socket's requests that are answered later (a plan, a version, a registration,
the cluster's status): a task each, at most `MAX_WAITING` per connection at once. A rank
needs a few; a flood of long waits (WaitVersion up to a day each) held a task apiece,
~4 KB, for as long as asked, after the rank left too."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any

from weightwire.protocol.errors import ErrorCode, ProtocolError

MAX_WAITING = 64


class Pending:
    """Per connection: its tasks, and whether each is only a wait (cancelled when the
    session ends: nobody is left to answer); work with effects finishes and cleans up."""

    def __init__(self, limit: int = MAX_WAITING) -> None:
        self.limit = limit
        self._by: dict[bytes, dict[asyncio.Task[None], bool]] = {}

    def check(self, identity: bytes) -> None:
        """ProtocolError (`busy`) when the connection may not start one more."""
        n = len(self._by.get(identity, ()))
        if n >= self.limit:
            raise ProtocolError(
                f"{n} requests of this connection are still waiting for their replies "
                f"(at most {self.limit}): wait for those first",
                code=ErrorCode.BUSY,
            )

    def start(
        self, identity: bytes, work: Coroutine[Any, Any, None], *, only_waits: bool
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._by.setdefault(identity, {})[task] = only_waits
        task.add_done_callback(functools.partial(self._done, identity))
        return task

    def _done(self, identity: bytes, task: asyncio.Task[None]) -> None:
        mine = self._by.get(identity)
        if mine is not None:
            mine.pop(task, None)
            if not mine:
                del self._by[identity]

    def count(self) -> int:
        """Requests waiting now, of every connection."""
        return sum(len(m) for m in self._by.values())

    def end(self, identity: bytes) -> None:
        """The connection's session ended: its waits are cancelled."""
        for task, only_waits in list(self._by.get(identity, {}).items()):
            if only_waits:
                task.cancel()

    def cancel_all(self) -> None:
        for mine in self._by.values():
            for task in mine:
                task.cancel()
