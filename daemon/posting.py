"""A publisher's posting of buckets: each bucket's prepared parts written on their
transports (an engine replica whose writes fail is dropped, the others go on), buckets
with delta payloads, buckets the rank packed in place (colocated), and what the rank is
told as each bucket's writes finish (through `RingSlots`: its ring slot is free)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from weightwire.protocol.errors import ErrorCode, TransferError, WeightwireError
from weightwire.protocol.plan import WriteOp, encode_imm
from weightwire.transport.base import POST_STAMPS, SlotFencing, Transport

from .deltas import bucket_writes
from .metrics import Recorder
from .prepared import Part, PreparedWrites
from .ringslots import Issued, RingSlots
from .runs import Run

T = TypeVar("T")


async def gather_now(*aws: Awaitable[T]) -> list[T | BaseException]:
    """`asyncio.gather(*aws, return_exceptions=True)`, but one awaitable alone is awaited
    here, in the caller's task: gather would start it as a task of its own, on the loop's
    next round, and the local socket reads every queued message first (a burst of
    BucketReady held the first bucket's copies back until all were read)."""
    if len(aws) == 1:
        try:
            return [await aws[0]]
        except Exception as exc:
            return [exc]
    return await asyncio.gather(*aws, return_exceptions=True)


class DropReplica(Protocol):
    """Engine replica `replica` gets no more of `run`'s version (the others go on)."""

    def __call__(self, run: Run, replica: int, err: WeightwireError) -> None: ...


@dataclass(frozen=True)
class Poster:
    """Posts one trainer rank's buckets, version after version."""

    job: str
    rank: int
    writes: PreparedWrites
    slots: RingSlots
    drop: DropReplica
    metrics: Recorder | None = None

    async def post(
        self,
        run: Run,
        buckets: tuple[int, ...],
        sent: dict[int, dict[int, int]],
        in_place: set[int],
    ) -> None:
        """All writes of some buckets; the first failure fails the run, once every write
        of them has finished (none may still read staging when the rank is told)."""
        outcomes = await gather_now(
            *(
                self._post_delta(run, b, sent[b])
                if b in sent
                else self._post_in_place(run, b)
                if b in in_place
                else self._post_bucket(run, b)
                for b in buckets
            )
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _parts(self, run: Run, bucket: int) -> list[Part]:
        """The bucket's writes prepared on their transports; elastic jobs: per engine
        replica, one whose node cannot be reached dropped."""
        writes = run.plan.buckets[bucket].writes
        if not run.plan.replicas:
            return await self.writes.parts(run, bucket, "", run.plan, writes, -1)
        parts: list[Part] = []
        for p in run.plan.replicas:
            if p.replica in run.dropped:
                continue
            ranks = set(p.ranks)
            mine = tuple(w for w in writes if w.dst_rank in ranks)
            h = p.plan_hash
            try:
                parts += await self.writes.parts(run, bucket, h, h, mine, p.replica)
            except WeightwireError as exc:  # its node cannot be reached: that replica only
                self.drop(run, p.replica, exc)
        return parts

    async def _post_bucket(self, run: Run, bucket: int) -> None:
        parts = await self._parts(run, bucket)
        if run.finished:  # failed meanwhile: nothing more of it is sent
            raise run.error or WeightwireError("the version already failed", code=ErrorCode.ABORTED)
        parts = [p for p in parts if p.replica not in run.dropped]
        high = encode_imm(run.version, 0)
        fenced = self.slots.fencing(run, bucket, parts)
        stamps: dict[str, float] | None = None
        if "first_issued" not in run.timeline:  # the version's first post: where start-up goes
            run.mark("first_routed")
            stamps = {}
        token = POST_STAMPS.set(stamps)
        try:
            outcomes = await self._post_parts(run, bucket, parts, fenced, high)
        finally:
            POST_STAMPS.reset(token)
        for key, at in sorted((stamps or {}).items(), key=lambda kv: kv[1]):
            run.mark(f"first_{key}", at)
        first: BaseException | None = None
        for part, results in zip(parts, outcomes, strict=True):
            err: BaseException | None = (
                results
                if isinstance(results, BaseException)
                else next((e for e in results if e is not None), None)
            )
            if err is not None and part.replica >= 0 and isinstance(err, WeightwireError):
                self.drop(run, part.replica, err)  # that replica only: the others go on
                continue
            if err is not None:
                first = first or err
                continue
            run.add_landed(part.nbytes, len(part.slots), part.by_node)
        if first is not None:
            raise first
        self._landed(run, bucket)

    async def _post_parts(
        self, run: Run, bucket: int, parts: list[Part], fenced: list[Issued | None], high: int
    ) -> list[list[BaseException | None] | BaseException]:
        """Every part posted on its transport (fenced where the slot asks for it)."""
        return await gather_now(
            *(
                p.transport.post_fenced(
                    p.prepared, [high | s for s in p.slots], self.slots.slot_key(run, bucket), f
                )
                if f is not None and isinstance(p.transport, SlotFencing)
                else p.transport.post(p.prepared, [high | s for s in p.slots])
                for p, f in zip(parts, fenced, strict=True)
            )
        )

    async def _post_in_place(self, run: Run, bucket: int) -> None:
        """A bucket the rank packed straight into its destinations' memory, on the GPU its
        staging is on, and whose bytes are visible there (it waited for its packing to
        finish before saying so): each write's immediate is delivered as its transport
        delivers those of its own writes, nothing is copied. Refused, failing the version,
        unless every write goes from staging to GPU memory of that same GPU through a
        transport that can deliver immediates so."""
        b = run.plan.buckets[bucket]
        by: dict[tuple[Transport, str], list[int]] = {}
        high = encode_imm(run.version, 0)
        for w in b.writes:
            route = await self.writes.route(run, (w.src_region, w.dst_node, w.dst_region))
            transport, src, dst = route
            key = dst.keys.cuda
            uuid = src.extra.get("device_uuid")
            if w.src_region != -1 or key is None or src.kind != "gpu" or key.device_uuid != uuid:
                raise TransferError(
                    f"bucket {bucket} was said packed in place, but its write to region "
                    f"{w.dst_region} of {w.dst_node} is not staging to the same GPU"
                )
            by.setdefault((transport, w.dst_node), []).append(high | w.slot)
        for (transport, node), imms in by.items():
            if not transport.deliver_written(node, imms):
                raise TransferError(
                    f"bucket {bucket} packed in place: its immediates could not be delivered "
                    f"to {node} by {transport.name}"
                )
        run.bytes_done += sum(w.nbytes for w in b.writes)
        run.writes_done += len(b.writes)
        self._landed(run, bucket, timed=False)

    async def _post_delta(self, run: Run, bucket: int, sent: dict[int, int]) -> None:
        """A bucket some of whose destinations get a delta payload (deltas.bucket_writes),
        its writes prepared for this version only."""
        writes, payloads = bucket_writes(run.plan.buckets[bucket], sent, run.ring.shift[bucket])
        run.delta_bytes += payloads
        await self.post_writes(run, writes)
        self._landed(run, bucket)

    async def post_writes(self, run: Run, writes: list[WriteOp]) -> None:
        """Writes made for this version only (prepared now, not cached)."""
        parts = await self.writes.grouped(run, writes)
        high = encode_imm(run.version, 0)
        outcomes = await asyncio.gather(
            *(
                t.post(t.prepare([r for _, r in items]), [high | w.slot for w, _ in items])
                for t, items in parts
            )
        )
        for (_, items), results in zip(parts, outcomes, strict=True):
            if any(results):
                raise next(e for e in results if e is not None)
            for w, _ in items:
                run.add_landed(w.nbytes, 1, ((w.dst_node, w.nbytes),))

    def _landed(self, run: Run, bucket: int, timed: bool = True) -> None:
        """Every write of `bucket` landed: its time in the metrics (`timed`), and its ring
        slot free (`RingSlots.slot_free`)."""
        landed = run.bucket_landed[bucket] = time.time()
        run.mark("first_landed")
        if timed and self.metrics is not None:
            self.metrics.bucket_landed(self.job, landed - run.bucket_posted[bucket])
        self.slots.slot_free(run, bucket)
