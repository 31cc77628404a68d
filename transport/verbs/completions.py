"""Completion delivery: each device's completion queue is drained on the event loop when
its completion channel's fd is readable (`add_reader`), or, where that fd cannot be had,
polled by a thread of the transport's own that hands the completions to the loop. Each
completion goes to the queue pair it belongs to: a send completion to the send path, a
receive to the receive path.

`get_cq_event` is never called blocking: pyverbs holds the GIL inside it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from .hw import OpenDevice
from .runtime import Runtime
from .state import InQp, Qp

Completions = Literal["auto", "channel", "thread"]


class Delivery:
    def __init__(
        self,
        rt: Runtime,
        send_done: Callable[[Qp, Any], None],
        recv_done: Callable[[InQp, Any], None],
    ) -> None:
        self.rt = rt
        self.send_done = send_done
        self.recv_done = recv_done
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._readers: list[int] = []

    def start(self, devs: list[OpenDevice]) -> list[OpenDevice]:
        """Watch the channel fds on the loop, poll the devices without one on a thread;
        returns those polled."""
        loop = self.rt.loop
        assert loop is not None
        polled = [d for d in devs if d.fd is None]
        for dev in devs:
            if dev.fd is not None:
                dev.cq.req_notify()
                loop.add_reader(dev.fd, self._readable, dev)
                self._readers.append(dev.fd)
                self._drain(dev)  # a completion that came before arming gives no event
        if polled:
            self._poller = threading.Thread(
                target=self._poll_thread, args=(polled,), name="verbs-poll", daemon=True
            )
            self._poller.start()
        return polled

    def stop(self) -> None:
        """Stop watching the fds and tell the polling thread to end (see `join`)."""
        if self.rt.loop is not None:
            for fd in self._readers:
                self.rt.loop.remove_reader(fd)
        self._readers.clear()
        self._stop.set()

    async def join(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) for the polling thread to end."""
        if self._poller is not None:
            await asyncio.to_thread(self._poller.join, timeout)

    def _readable(self, dev: OpenDevice) -> None:
        try:
            dev.channel.get_cq_event(dev.cq)
        except self.rt.api.Error:
            pass  # nothing queued (EAGAIN): poll anyway
        else:
            dev.cq.ack_events(1)
        dev.cq.req_notify()  # re-arm before polling: a CQE after the poll fires again
        self._drain(dev)

    def _drain(self, dev: OpenDevice, budget: int = 4096) -> None:
        if self.rt.closed:
            return
        while budget > 0:
            n, wcs = dev.cq.poll(64)
            if n:
                self._handle(dev, wcs)
                budget -= n
            if n < 64:
                return
        assert self.rt.loop is not None
        self.rt.loop.call_soon(self._drain, dev)  # let others run; more are waiting

    def _poll_thread(self, devs: list[OpenDevice]) -> None:
        """The fallback when a completion channel's fd is not available."""
        loop = self.rt.loop
        assert loop is not None
        idle = 0
        while not self._stop.is_set():
            got = False
            for dev in devs:
                try:
                    n, wcs = dev.cq.poll(64)
                except self.rt.api.Error:
                    return
                if n:
                    got = True
                    loop.call_soon_threadsafe(self._handle, dev, wcs)
            if got:
                idle = 0
            else:
                idle = min(idle + 1, 20)
                time.sleep(0.00005 * idle)

    def _handle(self, dev: OpenDevice, wcs: list[Any]) -> None:
        if self.rt.closed:
            return
        for wc in wcs:
            q = self.rt.qps.get((dev.name, int(wc.qp_num)))
            if isinstance(q, Qp):
                self.send_done(q, wc)
            elif isinstance(q, InQp):
                self.recv_done(q, wc)
