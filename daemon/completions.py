"""The engine ranks of this node, each one's `RankCompletion` found by the slot an
immediate carries: installed from the node's plan (a rank whose plan changed carries its
history and waiters over), and what the transports ask before a write lands (`admit`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.plan import Expect, decode_imm

from .completion import Apply, ApplyBucket, Fence, Notify, RankCompletion, Verdict
from .lograte import Throttled
from .metrics import Recorder

log = structlog.get_logger("weightwire.daemon.completion")


@dataclass
class Completions:
    """All engine ranks of this node, found by the slot an immediate carries."""

    notify: Notify
    apply: Apply | None = None
    verdict: Verdict | None = None
    fence: Fence | None = None
    metrics: Recorder | None = None
    apply_bucket: ApplyBucket | None = None
    ranks: dict[tuple[str, int], RankCompletion] = field(default_factory=dict)
    by_slot: dict[int, RankCompletion] = field(default_factory=dict)
    # ranks a plan left out (an elastic replica dropped while one of its ranks restarts):
    # their history and the waits under way, taken up when a plan has them again
    left: dict[tuple[str, int], RankCompletion] = field(default_factory=dict)
    _refused: Throttled = field(default_factory=Throttled)  # a peer can send them in a loop

    def install(self, job: str, plan_hash: str, expects: tuple[Expect, ...]) -> None:
        fresh: dict[tuple[str, int], RankCompletion] = {}
        whole = plan_hash
        for e in expects:
            plan_hash = e.plan_hash or whole  # elastic: the replica's own plan
            old = self.ranks.get((job, e.rank)) or self.left.pop((job, e.rank), None)
            if old is not None and old.plan_hash == plan_hash:
                fresh[(job, e.rank)] = old
                continue
            rc = RankCompletion(
                job=job,
                rank=e.rank,
                expect=e,
                plan_hash=plan_hash,
                notify=self.notify,
                apply=self.apply,
                verdict=self.verdict,
                fence=self.fence,
                metrics=self.metrics,
                apply_bucket=self.apply_bucket,
            )
            if old is not None:
                old.fail_in_progress(ErrorCode.PLAN_CHANGED, "the plan changed mid-version")
                rc.completed, rc.failed, rc.dead_lows = old.completed, old.failed, old.dead_lows
                rc.began = old.began
                rc.waiters, rc._reports = old.waiters, old._reports
            fresh[(job, e.rank)] = rc
        for key, old in self.ranks.items():
            if key[0] == job and key not in fresh:
                old.fail_in_progress(ErrorCode.PLAN_CHANGED, "the rank left the plan")
                self.left[key] = old  # a wait under way ends when the rank is back, or times out
        self.ranks = {k: v for k, v in self.ranks.items() if k[0] != job} | fresh
        self.by_slot = {rc.expect.slot: rc for rc in self.ranks.values()}

    def drop_job(self, job: str, reason: str, code: ErrorCode = ErrorCode.PLAN) -> None:
        """The job's plan is gone here: its versions in flight fail, and every wait on one of
        its ranks ends now with why (it used to run to its timeout, saying "no writes")."""
        for key in [k for k in self.ranks if k[0] == job]:
            self.ranks[key].fail_in_progress(code, reason)
            self.ranks[key].end_waits(code, reason)
        for key in [k for k in self.left if k[0] == job]:
            self.left.pop(key).end_waits(code, reason)
        self.ranks = {k: v for k, v in self.ranks.items() if k[0] != job}
        self.by_slot = {rc.expect.slot: rc for rc in self.ranks.values()}

    def on_imm(self, imm: int, source: str) -> None:
        low, slot = decode_imm(imm)
        rc = self.by_slot.get(slot)
        if rc is None:
            self._refused.emit(log.warning, "immediate for an unknown slot", slot=slot, peer=source)
            return
        if rc.expect.sources and source not in rc.expect.sources:
            # a node that may write to another rank of this node (an insider with a planned
            # region of its own) counted toward this rank's version: it completed early,
            # with bytes missing. As VersionStart, BucketLanded and VersionAbort, only the
            # rank's planned sources count.
            self._refused.emit(
                log.warning,
                "immediate from a node that is no source of its rank; not counted",
                job=rc.job,
                rank=rc.rank,
                slot=slot,
                peer=source,
            )
            return
        rc.on_imm(low)

    def admit(self, source: str, imm: int) -> bool:
        """False for a write of a version its destination rank has failed (tcp and cuda
        ask before any of its bytes land)."""
        low, slot = decode_imm(imm)
        rc = self.by_slot.get(slot)
        return rc is None or low not in rc.dead_lows

    def of_job(self, job: str) -> list[RankCompletion]:
        return [rc for (j, _), rc in self.ranks.items() if j == job]

    def end_rank(self, job: str, rank: int, reason: str, code: ErrorCode) -> None:
        """One engine rank of the job is refused: its version in flight fails and its waits
        end now with why; the job's other ranks go on."""
        rc = self.ranks.pop((job, rank), None) or self.left.pop((job, rank), None)
        if rc is not None:
            rc.fail_in_progress(code, reason)
            rc.end_waits(code, reason)
            self.by_slot = {r.expect.slot: r for r in self.ranks.values()}

    def get(self, job: str, rank: int) -> RankCompletion | None:
        return self.ranks.get((job, rank))
