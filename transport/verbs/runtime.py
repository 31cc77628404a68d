"""What every part of the verbs transport shares: the verbs API, the open devices, the
table that routes completions to queue pairs, the counters, the event loop, and the
worker threads that blocking verbs calls run on.

Everything here is touched on the event loop, except `busy` (under `lock`), which
registrations on the daemon's worker threads also count.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from .hw import OpenDevice
from .ibv import Api
from .state import InQp, Qp

T = TypeVar("T")


class Runtime:
    def __init__(self, node: str, api: Api, order: list[str]) -> None:
        self.node = node
        self.api = api
        self.E = api.E
        self.order = order  # the configured devices' names, in order
        self.devs: dict[str, OpenDevice] = {}
        self.qps: dict[tuple[str, int], Qp | InQp] = {}  # (device, qpn): whose completion
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.lock = threading.Lock()
        self.busy = 0  # verbs calls running on worker threads (close waits for them)
        self.qp_ops = 0  # of those, the ones that may touch queue pairs (counted on the loop)
        self.graveyard: list[Any] = []  # QPs to destroy once qp_ops is 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stats = {
            "bytes_sent": 0,
            "writes": 0,
            "wrs_posted": 0,
            "posts": 0,
            "imms_received": 0,
            "write_errors": 0,
            "error_completions": 0,
            "qp_rebuilds": 0,
            "links": 0,
            "incoming_qps": 0,
            "max_sq_used": 0,
            "checks": 0,
            "regions": 0,
        }

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Counts a verbs call that runs off the loop (close() waits for those)."""
        with self.lock:
            self.busy += 1
        try:
            yield
        finally:
            with self.lock:
                self.busy -= 1

    async def thread(self, fn: Callable[[], T]) -> T:
        """A blocking verbs call on a worker thread (close() waits for those running)."""
        self.qp_ops += 1
        try:
            with self.working():
                return await asyncio.to_thread(fn)
        finally:
            self.qp_ops -= 1
            if not self.qp_ops and self.graveyard:
                self.retire([])

    def forget_qp(self, dev: OpenDevice, qpn: int, objs: list[Any], cq_entries: int) -> None:
        """A queue pair goes: no more completions routed to it, it (and its WR parts, `objs`)
        destroyed once safe, its room on the CQ given back."""
        self.qps.pop((dev.name, qpn), None)
        self.retire(objs)
        dev.release_cq(cq_entries)

    def retire(self, objs: list[Any]) -> None:
        """Destroy queue pairs (and their WR parts) once no worker thread may be modifying
        one of them: destroying a QP under a running ibv_modify_qp is undefined."""
        self.graveyard.extend(objs)
        if self.qp_ops:
            return
        dead, self.graveyard = self.graveyard, []
        for obj in dead:
            with contextlib.suppress(Exception):
                obj.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
