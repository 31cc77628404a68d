"""`update_weights`: the sequence LMSYS published for P2P weight sync around one
weightwire version, on any number of SGLang servers at once::

    pause_generation -> flush_cache -> begin_weight_update -> transfer (the caller's:
    returns once the version has landed everywhere) -> end_weight_update
    -> update_weight_version -> continue_generation

and on any failure closes the weight-update session and re-raises. Generation continues
after a failure only where no byte of the version can have landed (the failure came before
the transfer began); from the transfer on, the engines stay paused unless the caller opts
in to serving what landed (`resume_on_failure=True`, with a warning): their weights may be
part new version while they still report the old one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import PauseMode, SGLangClient

log = logging.getLogger("weightwire.adapters.sglang")


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
    resume_on_failure: bool = False,
) -> UpdateReport:
    """One weight update on every engine: pause -> flush -> begin -> `transfer()` -> end ->
    update_weight_version -> continue, each step on all engines at once.

    `transfer` returns once `version` has landed in every engine rank: for weightwire,
    once every trainer rank's `publish(version)` has returned (each returns when all its
    writes landed), e.g. ``lambda: asyncio.to_thread(trainer.publish, step)``.
    `flush`: None = flush unless `pause_mode` is "in_place" (SGLang refuses to flush under
    requests paused in place). `weight_version`: default ``str(version)``.

    On a failure at any step it ends the weight-update session where one was opened
    (SGLang post-processes what landed) and re-raises the first error; what went wrong in
    that cleanup is added to it as notes. If the failure came before the transfer began,
    no weight changed: generation continues on every engine. From the transfer on, some
    of the version may have landed while the engines still report the previous one, so
    they stay paused (logged, and said in a note on the error): publish again and call
    `update_weights` with the next version, or `continue_generation()` to serve them as
    they are. `resume_on_failure=True` continues them anyway, with a warning.
    """
    report = UpdateReport(version=weight_version or str(version))
    engines = list(engines)
    if not engines:
        raise ValueError("update_weights needs at least one engine")
    do_flush = pause_mode != "in_place" if flush is None else flush
    opened: set[int] = set()  # engines whose weight-update session is open
    began = False  # the transfer was started: some of the version may have landed
    settled = False  # the version landed and the engines report it
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
        began = True
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
        settled = True
        await step("continue_generation", lambda e: e.continue_generation())
    except BaseException as exc:
        still_open = [e for e in engines if id(e) in opened]
        if still_open:
            await _cleanup(exc, still_open, lambda e: e.end_weight_update())
        if not began or settled:  # the weights are the version the engines report
            await _cleanup(exc, engines, lambda e: e.continue_generation())
        elif resume_on_failure:
            what = (
                f"resuming generation on {len(engines)} engine(s) whose weights may be partly "
                f"version {report.version} while they report the previous version "
                f"(resume_on_failure=True)"
            )
            log.warning(what)
            warnings.warn(what, RuntimeWarning, stacklevel=2)
            exc.add_note(what)
            await _cleanup(exc, engines, lambda e: e.continue_generation())
        else:
            what = (
                f"generation left paused on {len(engines)} engine(s): their weights may be "
                f"partly version {report.version} while they report the previous version; "
                f"update them again, or call continue_generation() to serve them as they are"
            )
            log.warning(what)
            exc.add_note(what)
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
