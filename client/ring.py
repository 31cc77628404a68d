"""A trainer rank's staging ring: which buckets have landed (their slots are free again),
and the pack ops of each bucket moved into its slot, made once per (bucket, slot)."""

from __future__ import annotations

import threading
import time

import msgspec

from weightwire.protocol.errors import TimeoutError_
from weightwire.protocol.plan import Bucket, PackOp, RankPlan, StagingRing


class Landed:
    """Buckets of one version whose writes have all finished, as the daemon reports them
    (`BucketsLanded`), or whose copies are all issued on the GPU, fenced by events
    (`BucketsIssued`), or the version's end (its `PublishResult`), on the connection's
    thread; the publishing thread waits for a slot here."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._buckets: set[int] = set()
        self._issued: dict[int, tuple[bytes, ...]] = {}
        self._ended = False

    def add(self, buckets: tuple[int, ...]) -> None:
        with self._cv:
            self._buckets.update(buckets)
            self._cv.notify_all()

    def issue(self, buckets: tuple[int, ...], events: tuple[bytes, ...]) -> None:
        """The buckets' copies are all queued on the GPU, each stream's followed by one of
        `events` (IPC handles): their slot is free to a stream that waits on those."""
        if not events:
            return
        with self._cv:
            for b in buckets:
                self._issued[b] = events
            self._cv.notify_all()

    def forget_issued(self) -> None:
        """The events cannot be waited on here: from now on only landings free a slot."""
        with self._cv:
            self._issued.clear()

    def events(self, bucket: int) -> tuple[bytes, ...]:
        """What a stream must wait on before writing `bucket`'s slot, once `poll` said
        True: nothing if it landed, else the events of its issued copies."""
        with self._cv:
            return () if bucket in self._buckets else self._issued.get(bucket, ())

    def end(self) -> None:
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    @property
    def ended(self) -> bool:
        """The version's result came (or the daemon was lost): nothing more will land."""
        return self._ended

    def wait(self, bucket: int, timeout_s: float, what: str, *, issued: bool = False) -> bool:
        """True once `bucket` has landed (or, with `issued`, been issued: see `events`);
        False if the version ended first (failed: its result says why). Raises
        TimeoutError_ after `timeout_s`."""
        outcome = self.poll(bucket, timeout_s, issued=issued)
        if outcome is None:
            raise self.timed_out(bucket, timeout_s, what)
        return outcome

    @staticmethod
    def timed_out(bucket: int, timeout_s: float, what: str) -> TimeoutError_:
        return TimeoutError_(
            f"{what}: bucket {bucket}'s writes did not finish within "
            f"{timeout_s:.0f} s, so its staging slot never came free"
        )

    def poll(self, bucket: int, timeout_s: float, *, issued: bool = False) -> bool | None:
        """As `wait`, but None (no error) if `bucket` has not landed within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while bucket not in self._buckets and not (issued and bucket in self._issued):
                if self._ended:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
        return True


def slot_wait(ring: StagingRing, bucket: int, in_place: set[int]) -> int:
    """The bucket whose writes must finish before `bucket` is packed into its slot (-1:
    none): the last one before it that really packed in that slot. Buckets packed in place
    (`in_place`, colocated) never touched their slot, so the wait goes back past them."""
    reuse = ring.reuse[bucket]
    while reuse in in_place:
        reuse = ring.reuse[reuse]
    return reuse


class SlotOps:
    """Each bucket's pack ops moved into its ring slot: made once per (plan, bucket, shift)
    and then the same tuple every version, so the packer's batched work (and its CUDA
    graph) made for it is kept."""

    def __init__(self) -> None:
        self._plan = ""
        self._ops: dict[tuple[int, int], tuple[PackOp, ...]] = {}

    def of(self, plan: RankPlan, ring: StagingRing, bucket: Bucket) -> tuple[PackOp, ...]:
        shift = ring.shift[bucket.index]
        if not shift:
            return bucket.packs
        if plan.plan_hash != self._plan:
            self._plan, self._ops = plan.plan_hash, {}
        key = (bucket.index, shift)
        ops = self._ops.get(key)
        if ops is None:
            ops = self._ops[key] = tuple(
                msgspec.structs.replace(op, staging_offset=op.staging_offset + shift)
                for op in bucket.packs
            )
        return ops
