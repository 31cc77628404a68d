"""--time-budget and SIGTERM: when `weightwire bench gpu` stops measuring."""

from __future__ import annotations

import time
from typing import Any

from .errors import Interrupted


class Budget:
    """--time-budget: stop measuring more versions (and start no more runs) when the next
    one would not finish in time, so the report is always written."""

    deadline: float | None = None
    run_deadline: float | None = None  # this run's share of what is left
    interrupted = False

    @classmethod
    def left(cls) -> float:
        return float("inf") if cls.deadline is None else cls.deadline - time.monotonic()

    @classmethod
    def run_left(cls) -> float:
        if cls.run_deadline is None:
            return cls.left()
        return min(cls.left(), cls.run_deadline - time.monotonic())


def on_signal(signum: int, frame: Any) -> None:
    if Budget.interrupted:
        return  # already stopping: let the cleanup finish
    Budget.interrupted = True
    raise Interrupted(f"interrupted by signal {signum}")
