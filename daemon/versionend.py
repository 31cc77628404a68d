"""How one trainer rank's version ends, landed or failed: the run is marked finished, the
rank is answered (its `PublishResult`), then one log line and the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from weightwire.protocol.errors import WeightwireError

from .metrics import Recorder
from .ringslots import Reply, release
from .runs import Run
from .versionlog import gbyte_s

log = structlog.get_logger("weightwire.daemon.publisher")  # the publisher's lines


@dataclass(frozen=True)
class VersionEnd:
    """The end of a rank's versions: `finish` (every write landed, every verdict in) or
    `fail` (the first cause), each once per run."""

    job: str
    rank: int
    reply: Reply
    metrics: Recorder | None = None
    """Told of each finished version (never per write)."""

    def finish(self, run: Run) -> None:
        run.finished = True
        now = time.monotonic()
        seconds = now - run.started
        # The rank hears first: its next BeginVersion must not queue behind this version's
        # log line and metrics (0.2 ms a version on a GPU host), written right after.
        self.reply(run.result(now))
        log.debug(
            "publish complete",
            rank=self.rank,
            version=run.version,
            bytes=run.bytes_done,
            writes=run.writes_done,
            seconds=round(seconds, 6),
            gbyte_s=gbyte_s(run.bytes_done, seconds),
            staging_buckets=run.ring.slots,
        )
        self._record(run, seconds, None)

    def fail(self, run: Run, err: WeightwireError, announce: Callable[[str], None] | None) -> None:
        """`run` failed with `err`: `announce(message)`, when given, tells its destinations
        to fail the version (after the log line, before the rank is answered)."""
        run.finished = True
        run.error = err
        release(run)
        log.warning(
            "publish failed",
            rank=self.rank,
            version=run.version,
            code=err.code.value,
            error=err.message,
            bytes=run.bytes_done,
        )
        if announce is not None:
            announce(f"[{err.code.value}] {err.message}")
        now = time.monotonic()
        self.reply(run.result(now, err))  # before the log line and metrics, as in `finish`
        self._record(run, now - run.started, err.code.value)

    def _record(self, run: Run, seconds: float, code: str | None) -> None:
        """The rank's finished version in the metrics (code None: it landed)."""
        if self.metrics is not None:
            self.metrics.rank_version(
                self.job, "trainer", self.rank, run.version, run.bytes_done, seconds,
                run.peer_bytes, code, run.timeline,
            )  # fmt: skip
