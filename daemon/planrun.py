"""The planner run off the event loop, stopped when a replan supersedes it.

A replan cancels the coordinator's planning task, but a thread already in the planner ran
on to the end: its plan was thrown away, and each replan of a burst (replicas joining one
after another, a node's ranks registering in turn) left one more such thread working on
the executor, ahead of the planning that counts. Each run holds a `Stop`; the planner
checks it at every phase (its `progress` hook), and a run that is superseded stops there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import structlog

from weightwire.plan.planner import EngineRank, PlanOptions, TrainerRank, plan

if TYPE_CHECKING:
    from weightwire.plan.compact import PlanSet

log = structlog.get_logger("weightwire.daemon.coordinator")


class Superseded(Exception):
    """A planning run's inputs changed: its work would be thrown away."""


class Stop:
    """One planning run's stop flag: set when a replan supersedes it (or the job ends)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.phase = ""  # the planner's phase, while a thread plans (status shows it)
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self, phase: str) -> None:
        if self._event.is_set():
            raise Superseded(phase)


async def planned(
    stop: Stop,
    job: str,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    options: PlanOptions,
    slots: dict[int, int],
) -> PlanSet:
    """`plan(...)` in a thread; raises asyncio.CancelledError if `stop` is set meanwhile
    (the thread stops at the planner's next phase, one line logged)."""

    def run() -> PlanSet | None:
        t0 = time.monotonic()
        stop.phase = "queued"

        def check(now: str) -> None:
            stop.check(stop.phase)
            stop.phase = now

        try:
            check("indexing the sources")
            out = plan(job, trainers, engines, options, slots, progress=check)
            check("done")
            return out
        except Superseded:
            log.info(
                "planning superseded",
                job=stop.job,
                after=stop.phase,  # the last phase it began ("queued": it never started)
                seconds=round(time.monotonic() - t0, 4),
            )
            return None

    out = await asyncio.to_thread(run)
    if out is None:  # superseded: the task that awaits it is cancelled (or is about to be)
        raise asyncio.CancelledError
    return out
