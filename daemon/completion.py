"""The destination side: counting immediates per (version, engine rank).

An engine rank's version is complete when exactly the planned number of immediates
has arrived in its slot, each one sent only after its bytes landed, and some source
has announced the full version number (immediates carry only its low 16 bits). A
version that fails is never completed; late immediates for it are ignored. How an
outcome is told, and waiting for one: `completionwaits.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from weightwire.protocol.errors import ErrorCode, error_from_code
from weightwire.protocol.local import VersionComplete, VersionFailed
from weightwire.protocol.peer import BucketLanded, LandedPart
from weightwire.protocol.plan import Expect, version_low

from . import completionwaits as waits
from .lograte import Throttled
from .metrics import Recorder
from .versionlog import gbyte_s

log = structlog.get_logger("weightwire.daemon.completion")

Notify = Callable[[str, int, VersionComplete | VersionFailed], None]
"""notify(job, rank, message) pushes a message to the rank's engine sessions."""
Apply = Callable[["RankCompletion", int], None]
"""apply(rank, version): every write landed at a rank with a delta area: the engine must
apply and verify the version (it answers through `on_applied`)."""
ApplyBucket = Callable[["RankCompletion", BucketLanded, LandedPart], None]
"""apply_bucket(rank, note, its part): a bucket of a version in progress landed at the
rank: the engine may apply and checksum it before the version's end."""
Verdict = Callable[["RankCompletion", int, bool, str, str], None]
"""verdict(rank, version, ok, code, message): tell the version's sources the outcome."""

Fence = Callable[[tuple[str, ...], str], Awaitable[None]]
"""fence(nodes, reason): returns once no write of those nodes can land here any more."""

HISTORY = 64
_stray = Throttled()  # `Applied` answers nobody asked for, logged once per interval
_stale = Throttled()  # starts of versions older than the last complete, likewise


def _now(method: Callable[..., None], event: str, **fields: object) -> None:
    method(event, **fields)


@dataclass
class _InProgress:
    low: int
    version: int | None = None
    count: int = 0
    started: float = field(default_factory=time.monotonic)
    first_imm: float | None = None
    sources: set[str] = field(default_factory=set)
    began: set[tuple[str, int]] = field(default_factory=set)  # (node, rank) of its starts
    applying: bool = False


@dataclass
class RankCompletion:
    job: str
    rank: int
    expect: Expect
    plan_hash: str
    notify: Notify
    fence: Fence | None = None
    current: dict[int, _InProgress] = field(default_factory=dict)
    completed: deque[VersionComplete] = field(default_factory=lambda: deque(maxlen=HISTORY))
    failed: dict[int, VersionFailed] = field(default_factory=dict)
    began: dict[int, set[tuple[str, int]]] = field(default_factory=dict)
    """(node, rank) of the sources that started each completed version (the last HISTORY)."""
    dead_lows: dict[int, int] = field(default_factory=dict)  # low bits -> failed version
    waiters: dict[int, list[asyncio.Future[VersionComplete]]] = field(default_factory=dict)
    apply: Apply | None = None
    verdict: Verdict | None = None
    metrics: Recorder | None = None
    apply_bucket: ApplyBucket | None = None

    @property
    def verified(self) -> bool:
        """Delta-capable plan: a version completes only once the engine applied and verified it."""
        return self.expect.delta_region >= 0 and self.apply is not None

    _reports: asyncio.Task[None] | None = None  # the last report still being made

    @property
    def last_complete(self) -> int:
        return self.completed[-1].version if self.completed else -1

    def _slot_for(self, low: int) -> _InProgress | None:
        st = self.current.get(low)
        if st is None:
            if low in self.dead_lows:
                return None  # a late immediate of a failed version
            st = self.current[low] = _InProgress(low=low)
        return st

    def on_imm(self, low: int) -> None:
        st = self._slot_for(low)
        if st is None:
            return
        st.count += 1
        if st.first_imm is None:
            st.first_imm = time.monotonic()
        if st.count > self.expect.count:
            self.fail_low(
                low, ErrorCode.INTERNAL, f"more immediates than the plan's {self.expect.count}"
            )
        elif st.count == self.expect.count and st.version is not None:
            self._landed(st)

    def _completed(self, version: int) -> bool:
        return any(done.version == version for done in self.completed)

    def on_start(self, version: int, source: str, source_rank: int = -1) -> None:
        low = version_low(version)
        if version in self.failed:
            return  # another source of a version already settled here
        if self._completed(version):
            began = self.began.setdefault(version, set())
            if source_rank < 0 or (source, source_rank) not in began:
                began.add((source, source_rank))
                return  # another source rank's start, late: nothing to say
            # The same source rank starts it again (a trainer rank resumed from a
            # checkpoint, numbering from there): it would never complete here, its
            # writes overwriting the version the rank holds. It fails as a stale start
            # does: its later writes refused (its low bits dead), its source fenced.
            st = self.current.get(low)
            seen = st is not None and st.version is None
            self._fail(
                version,
                ErrorCode.ABORTED,
                f"version {version} already completed here, started by trainer rank "
                f"{source_rank} of {source} before: versions only go forwards, publish "
                f"version {self.last_complete + 1} or later",
                fence=(source,),
                quiet=not seen,
            )
            return
        if version < self.last_complete:
            # It never completed here and never will: it fails, for any wait, and its source
            # is fenced (it would write a stale version: stop it, not the others). The rank
            # hears it if some of its writes landed here; of a version it never saw a byte
            # of (a stale start, or a forged one: a source can send these in a loop) it is
            # not told, and the line is logged once per interval.
            st = self.current.get(low)
            seen = st is not None and st.version in (None, version)
            self._fail(
                version,
                ErrorCode.ABORTED,
                f"superseded by version {self.last_complete}",
                fence=(source,),
                quiet=not seen,
            )
            return
        if self.dead_lows.get(low) is not None and self.dead_lows[low] != version:
            del self.dead_lows[low]  # a new version reuses these low bits
            self.current.pop(low, None)
        st = self._slot_for(low)
        if st is None:
            return
        if st.version is not None and st.version != version:
            self.fail(st.version, ErrorCode.ABORTED, f"version {version} reuses its immediates")
            st = self._slot_for(low)
            assert st is not None
        st.version = version
        st.sources.add(source)
        st.began.add((source, source_rank))
        if st.count == self.expect.count:
            self._landed(st)

    def on_bucket(self, note: BucketLanded, part: LandedPart) -> None:
        """A source says every write of one bucket landed here: the engine applies and
        checksums it now (only for a version in progress here, which that source rank
        started: its `VersionStart` came first on the same connection; whether the version
        completes is still decided by the immediates and the trailers' checksums).

        A note of a version nobody started here (an insider's, with its node's valid key)
        once reached the engine, which stops holding a verified version at a version's first
        bucket: the next real delta version failed as against a stale base. A dropped note
        costs nothing but time: `ApplyVersion` does what no note covered."""
        version = note.version
        if not self.verified or self.apply_bucket is None:
            return
        if version in self.failed or self._completed(version) or version < self.last_complete:
            return
        st = self.current.get(version_low(version))
        if st is None or st.version != version or st.applying:
            return  # not started here, another version, or being applied already (late)
        if (note.source_node, note.source_rank) not in st.began:
            return  # a source rank that did not start it
        self.apply_bucket(self, note, part)

    def _landed(self, st: _InProgress) -> None:
        """Every write is in: complete, or first have the engine apply and verify it."""
        assert st.version is not None
        if not self.verified:
            self._complete(st)
        elif not st.applying:
            st.applying = True
            assert self.apply is not None
            self.apply(self, st.version)

    def on_applied(self, version: int, ok: bool, code: str, message: str) -> None:
        """The engine's answer to `apply`: the version is complete only if it verified."""
        st = next((s for s in self.current.values() if s.version == version), None)
        if st is None or not st.applying:  # a rank can send these in a loop: one line a while
            _stray.emit(
                log.warning,
                "applied for a version not being applied",
                rank=self.rank,
                version=version,
            )
            return
        if ok:
            self._complete(st)
        else:
            try:
                err = ErrorCode(code)
            except ValueError:
                err = ErrorCode.CHECKSUM
            # Not fenced: every write of this version already landed (its immediates were
            # counted), so none can land late. A fence would close the sources' streams
            # while their receive threads may still owe the last writes' acks, and a source
            # would then fail the version as peer_lost before this verdict reached it.
            self.fail(version, err, message, fence=())

    def _complete(self, st: _InProgress) -> None:
        assert st.version is not None
        del self.current[st.low]
        now = time.monotonic()
        seconds = now - min(st.started, st.first_imm or now)
        done = VersionComplete(
            rank=self.rank, version=st.version, nbytes=self.expect.nbytes, seconds=seconds
        )
        self.completed.append(done)
        self.began[st.version] = st.began
        while len(self.began) > HISTORY:
            self.began.pop(next(iter(self.began)))
        log.debug(
            "version complete",
            rank=self.rank,
            version=st.version,
            bytes=self.expect.nbytes,
            writes=self.expect.count,
            seconds=round(seconds, 6),
            gbyte_s=gbyte_s(self.expect.nbytes, seconds),
            sources=sorted(st.sources),
        )
        self._record(st.version, self.expect.nbytes, seconds, None)
        waiters = self.waiters.pop(st.version, [])
        version = st.version

        def settle() -> None:
            if self.verified and self.verdict is not None:
                self.verdict(self, version, True, "", "")
            for fut in waiters:
                if not fut.done():
                    fut.set_result(done)

        self._report(done, settle, ())
        for other in [s for s in self.current.values() if s.version is not None]:
            assert other.version is not None
            if other.version < st.version:
                # Not fenced: every source finished this version's writes before it began
                # the newer one, and fencing now would cut the newer ones already flowing.
                # (A late write of it is still refused by admission on tcp and cuda.)
                self.fail(
                    other.version,
                    ErrorCode.ABORTED,
                    f"superseded by version {st.version}",
                    fence=(),
                )

    def _record(self, version: int, nbytes: int, seconds: float, code: str | None) -> None:
        """The version's outcome in the metrics (if any)."""
        if self.metrics is not None:
            sources = dict.fromkeys(self.expect.sources, 0)
            self.metrics.rank_version(
                self.job, "engine", self.rank, version, nbytes, seconds, sources, code
            )

    def fail(
        self, version: int, code: ErrorCode, message: str, *, fence: tuple[str, ...] | None = None
    ) -> None:
        """Version `version` failed here, unless it already completed or failed."""
        if version in self.failed or self._completed(version):
            return
        self._fail(version, code, message, fence=fence)

    def _fail(
        self,
        version: int,
        code: ErrorCode,
        message: str,
        *,
        fence: tuple[str, ...] | None = None,
        quiet: bool = False,
    ) -> None:
        """Reported only once the nodes in `fence` (None: every source) are fenced; `quiet`:
        not to the rank's sessions, and logged once per interval."""
        low = version_low(version)
        st = self.current.get(low)
        if st is not None and st.version in (None, version):
            del self.current[low]
        self.dead_lows[low] = version
        msg = VersionFailed(rank=self.rank, version=version, code=code.value, message=message)
        self.failed[version] = msg
        while len(self.failed) > HISTORY:
            self.failed.pop(next(iter(self.failed)))
        (_stale.emit if quiet else _now)(
            log.warning,
            "version failed",
            rank=self.rank,
            version=version,
            code=code.value,
            error=message,
        )
        seconds = time.monotonic() - st.started if st is not None else 0.0
        self._record(version, 0, seconds, code.value)
        waiters = self.waiters.pop(version, [])

        def settle() -> None:
            if self.verified and self.verdict is not None:
                self.verdict(self, version, False, code.value, message)
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(error_from_code(code.value, message))

        fenced = self.expect.sources if fence is None else fence
        self._report(msg, settle, fenced, tell=not quiet)

    def _report(
        self,
        msg: VersionComplete | VersionFailed,
        settle: Callable[[], None],
        fence: tuple[str, ...],
        *,
        tell: bool = True,
    ) -> None:
        waits.report(self, msg, settle, fence, tell=tell)

    def fail_low(self, low: int, code: ErrorCode, message: str) -> None:
        st = self.current.get(low)
        if st is not None and st.version is not None:
            self.fail(st.version, code, message)
        else:
            self.current.pop(low, None)
            self.dead_lows[low] = -1

    def fail_in_progress(self, code: ErrorCode, message: str, source: str | None = None) -> None:
        if source is not None and source not in self.expect.sources:
            return
        for st in list(self.current.values()):
            self.fail_low(st.low, code, message)

    def end_waits(self, code: ErrorCode, message: str) -> None:
        """The rank's plan is gone: every wait for a version of it ends now, with why."""
        waits.end_waits(self, code, message)

    def expire(self, timeout_s: float) -> None:
        now = time.monotonic()
        for st in list(self.current.values()):
            if now - st.started > timeout_s:
                what = f"version {st.version}" if st.version is not None else "a version"
                msg = f"{what} got {st.count} of {self.expect.count} writes in {timeout_s:.0f} s"
                self.fail_low(st.low, ErrorCode.TIMEOUT, msg)

    async def wait(self, version: int, timeout_s: float) -> VersionComplete:
        return await waits.wait(self, version, timeout_s)

    def progress(self) -> dict[str, object]:
        return waits.progress(self)
