"""`update_weights`: the sequence LMSYS published for P2P weight sync around one
weightwire version, on any number of SGLang servers at once::

    pause_generation -> flush_cache -> begin_weight_update -> transfer (the caller's:
    returns once the version has landed everywhere) -> end_weight_update
    -> update_weight_version -> continue_generation

and on any failure closes the weight-update session, continues generation and re-raises.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import PauseMode, SGLangClient


@dataclass
class UpdateReport:
    """What `update_weights` did: the transfer's result and each step's seconds."""

    version: str
    result: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    paused_s: float = 0.0  # from pausing until generation continued


async def update_weights(
    engines: Sequence[SGLangClient],
    version: int | str,
    transfer: Callable[[], Awaitable[Any]],
    *,
    pause_mode: PauseMode = "abort",
    flush: bool | None = None,
    flush_wait_s: float = 0.0,
    weight_version: str | None = None,
    resume_on_failure: bool = True,
) -> UpdateReport:
    """One weight update on every engine: pause -> flush -> begin -> `transfer()` -> end ->
    update_weight_version -> continue, each step on all engines at once.

    `transfer` returns once `version` has landed in every engine rank: for weightwire,
    once every trainer rank's `publish(version)` has returned (each returns when all its
    writes landed), e.g. ``lambda: asyncio.to_thread(trainer.publish, step)``.
    `flush`: None = flush unless `pause_mode` is "in_place" (SGLang refuses to flush under
    requests paused in place). `weight_version`: default ``str(version)``.

    On a failure at any step it ends the weight-update session where one was opened
    (SGLang post-processes what landed), continues generation on every engine (unless
    `resume_on_failure` is False: they stay paused for a retry) and re-raises the first
    error; what went wrong in that cleanup is added to it as notes. After a failed
    transfer the engines serve whatever part of the version landed until a later version
    succeeds.
    """
    report = UpdateReport(version=weight_version or str(version))
    engines = list(engines)
    if not engines:
        raise ValueError("update_weights needs at least one engine")
    do_flush = pause_mode != "in_place" if flush is None else flush
    opened: set[int] = set()  # engines whose weight-update session is open
    t_pause = time.perf_counter()

    async def step(name: str, fn: Callable[[SGLangClient], Awaitable[Any]]) -> None:
        t0 = time.perf_counter()
        await _on_all(engines, fn)
        report.seconds[name] = time.perf_counter() - t0

    try:
        await step("pause_generation", lambda e: e.pause_generation(pause_mode))
        if do_flush:
            await step("flush_cache", lambda e: e.flush_cache(wait_s=flush_wait_s))

        async def begin(e: SGLangClient) -> None:
            await e.begin_weight_update()
            opened.add(id(e))

        await step("begin_weight_update", begin)
        t0 = time.perf_counter()
        report.result = await transfer()
        report.seconds["transfer"] = time.perf_counter() - t0

        async def end(e: SGLangClient) -> None:
            await e.end_weight_update()
            opened.discard(id(e))

        await step("end_weight_update", end)
        await step(
            "update_weight_version",
            lambda e: e.update_weight_version(report.version, abort_all_requests=False),
        )
        await step("continue_generation", lambda e: e.continue_generation())
    except BaseException as exc:
        still_open = [e for e in engines if id(e) in opened]
        if still_open:
            await _cleanup(exc, still_open, lambda e: e.end_weight_update())
        if resume_on_failure:
            await _cleanup(exc, engines, lambda e: e.continue_generation())
        raise
    report.paused_s = time.perf_counter() - t_pause
    return report


async def _on_all(
    engines: Sequence[SGLangClient], fn: Callable[[SGLangClient], Awaitable[Any]]
) -> None:
    """`fn` on every engine at once; the first failure is raised, the others as its notes."""
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also: {other}")
        raise first


async def _cleanup(
    exc: BaseException,
    engines: Sequence[SGLangClient],
    fn: Callable[[SGLangClient], Awaitable[Any]],
) -> None:
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    for e, r in zip(engines, results, strict=True):
        if isinstance(r, BaseException):
            exc.add_note(f"while recovering on {e.url}: {r}")
