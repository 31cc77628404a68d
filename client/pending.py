"""A trainer rank's versions in flight: each one's result future and what of it has landed
or been issued, fed by the daemon's notifications (on the connection's thread)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from weightwire.protocol.local import BucketsIssued, BucketsLanded, LocalMessage, PublishResult

from .ring import Landed


class PendingVersions:
    def __init__(self) -> None:
        self._results: dict[int, Future[PublishResult]] = {}
        self._landed: dict[int, Landed] = {}
        self._begun: set[int] = set()  # versions the daemon accepted (BeginVersion replied)
        self._lock = threading.Condition()  # notified as versions close

    def open(self, version: int) -> tuple[Future[PublishResult], Landed]:
        """Before BeginVersion: its result may come back before the reply is read (a
        version an engine's daemon refuses at once)."""
        fut: Future[PublishResult] = Future()
        landed = Landed()
        with self._lock:
            self._results[version] = fut
            self._landed[version] = landed
        return fut, landed

    def begun(self, version: int) -> None:
        """The daemon accepted it: from now on `fail` fails it too."""
        with self._lock:
            self._begun.add(version)

    def close(self, version: int) -> None:
        with self._lock:
            self._results.pop(version, None)
            self._landed.pop(version, None)
            self._begun.discard(version)
            self._lock.notify_all()

    def idle(self, timeout_s: float) -> bool:
        """Wait until no version is in flight (a publish of another thread has ended)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._results, timeout_s)

    def notify(self, msg: LocalMessage) -> None:
        if isinstance(msg, BucketsLanded):
            with self._lock:
                landed = self._landed.get(msg.version)
            if landed is not None:
                landed.add(msg.buckets)
        elif isinstance(msg, BucketsIssued):
            with self._lock:
                landed = self._landed.get(msg.version)
            if landed is not None:
                landed.issue(msg.buckets, msg.events)
        elif isinstance(msg, PublishResult):
            with self._lock:
                fut = self._results.get(msg.version)
                landed = self._landed.get(msg.version)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            if landed is not None:
                landed.end()

    def fail(self, exc: Exception) -> None:
        """Every version in flight fails with `exc` (the daemon restarted or was lost). One
        still beginning is left be: its BeginVersion goes to the daemon there is now, or
        fails itself."""
        with self._lock:
            pending = [f for v, f in self._results.items() if v in self._begun]
            ends = [landed for v, landed in self._landed.items() if v in self._begun]
        for fut in pending:
            if not fut.done():
                fut.set_exception(exc)
        for landed in ends:
            landed.end()
