"""A rank's versions as its engine sees them (`completion.RankCompletion`): the outcome of
each told to its sessions and waiters, in order and only once the sources to fence are
fenced; waiting for a version; and the rank's progress, for status."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from weightwire.protocol.errors import ErrorCode, WeightwireError, error_from_code
from weightwire.protocol.local import VersionComplete, VersionFailed

if TYPE_CHECKING:
    from .completion import RankCompletion

log = structlog.get_logger("weightwire.daemon.completion")


def report(
    rc: RankCompletion,
    msg: VersionComplete | VersionFailed,
    settle: Callable[[], None],
    fence: tuple[str, ...],
    *,
    tell: bool = True,
) -> None:
    """Tell the engine's sessions (`tell`) and waiters, once the nodes in `fence` are
    fenced and after any report of this rank still being made."""
    before = rc._reports
    if (before is None or before.done()) and (not fence or rc.fence is None):
        if tell:
            rc.notify(rc.job, rc.rank, msg)
        settle()
        return

    async def later() -> None:
        if before is not None:
            await asyncio.wait([before])
        if fence and rc.fence is not None:
            reason = f"version {msg.version} failed at rank {rc.rank}"
            try:
                await rc.fence(fence, reason)
            except Exception as exc:  # the fence logs what it could not do; report anyway
                log.error("fence failed", rank=rc.rank, version=msg.version, error=repr(exc))
        if tell:
            rc.notify(rc.job, rc.rank, msg)
        settle()

    rc._reports = asyncio.get_running_loop().create_task(later())


async def wait(rc: RankCompletion, version: int, timeout_s: float) -> VersionComplete:
    for done in rc.completed:
        if done.version == version:
            return done
    if version in rc.failed:
        f = rc.failed[version]
        raise error_from_code(f.code, f.message)
    if version < rc.last_complete:
        raise WeightwireError(
            f"version {version} was never completed here; {rc.last_complete} was",
            code=ErrorCode.ABORTED,
        )
    fut: asyncio.Future[VersionComplete] = asyncio.get_running_loop().create_future()
    rc.waiters.setdefault(version, []).append(fut)
    try:
        return await asyncio.wait_for(fut, timeout_s)
    except TimeoutError:
        st = next((s for s in rc.current.values() if s.version == version), None)
        got = f"{st.count} of {rc.expect.count} writes" if st else "no writes"
        raise error_from_code(
            ErrorCode.TIMEOUT.value,
            f"version {version} not complete after {timeout_s:.0f} s ({got})",
        ) from None


def end_waits(rc: RankCompletion, code: ErrorCode, message: str) -> None:
    """The rank's plan is gone: every wait for a version of it ends now, with why."""
    waiters, rc.waiters = rc.waiters, {}
    for futs in waiters.values():
        for fut in futs:
            if not fut.done():
                fut.set_exception(error_from_code(code.value, message))


def progress(rc: RankCompletion) -> dict[str, object]:
    return {
        "rank": rc.rank,
        "slot": rc.expect.slot,
        "expected_writes": rc.expect.count,
        "expected_bytes": rc.expect.nbytes,
        "sources": list(rc.expect.sources),
        "last_complete": rc.last_complete,
        "in_progress": [
            {
                "version": st.version,
                "writes": st.count,
                "fraction": st.count / rc.expect.count if rc.expect.count else 1.0,
            }
            for st in rc.current.values()
        ],
        "failed": sorted(rc.failed)[-5:],
    }
