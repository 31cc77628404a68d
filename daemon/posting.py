"""A publisher's posting of buckets: each bucket's prepared parts written on their
transports (an engine replica whose writes fail is dropped, the others go on), buckets
with delta payloads, buckets the rank packed in place (colocated), and what the rank is
told as each bucket's writes finish (through `RingSlots`: its ring slot is free)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextvars import Token
from dataclasses import dataclass
from typing import Protocol, TypeVar

from weightwire.protocol.errors import ErrorCode, TransferError, WeightwireError
from weightwire.protocol.plan import WriteOp, encode_imm
from weightwire.transport.base import POST_STAMPS, GpuGating, SlotFencing, Transport

from .deltas import bucket_writes
from .metrics import Recorder
from .packgate import WAIT_S
from .prepared import Part, PreparedWrites
from .ringslots import RingSlots
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
    on_landed: Callable[[Run, int, dict[int, int]], None] | None = None
    """on_landed(run, bucket, delta payloads sent): every write of a bucket landed."""

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
        if run.gate is not None:  # see `_handed`
            run.handed[bucket] = asyncio.get_running_loop().create_future()
        try:
            await self._post_gated_or_not(run, bucket)
        finally:
            self.slots.handed(run, bucket)  # its post ended: nothing of it records a fence

    async def _post_gated_or_not(self, run: Run, bucket: int) -> None:
        gate = run.gate
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]] | None = None
        if gate is not None:  # a rank's buckets reach its lanes in bucket order
            turn = (gate.chain, asyncio.get_running_loop().create_future())
            gate.chain = turn[1]
        stamps: dict[str, float] | None = None
        token: Token[dict[str, float] | None] | None = None
        try:
            parts = await self._parts(run, bucket)
            if turn is not None and turn[0] is not None:
                await turn[0]  # the bucket before has made its posts
            await self._handed(run, bucket)
            if run.finished:  # failed meanwhile: nothing more of it is sent
                raise run.error or WeightwireError(
                    "the version already failed", code=ErrorCode.ABORTED
                )
            parts = [p for p in parts if p.replica not in run.dropped]
            on_gpu = gate is not None and all(isinstance(p.transport, GpuGating) for p in parts)
            if gate is not None and not on_gpu:  # a transport the GPU cannot hold back
                await gate.wait(bucket, WAIT_S)
            high = encode_imm(run.version, 0)
            fenced = self.slots.fencing(run, bucket, parts)
            if all(f is None for f in fenced):
                self.slots.handed(run, bucket)  # no fence: no event of its slot recorded
            if "first_issued" not in run.timeline:  # the version's first post: start-up
                run.mark("first_routed")
                stamps = {}
            token = POST_STAMPS.set(stamps)  # before any task is made: they copy it
            posts = [
                self._post_part(run, bucket, p, [high | s for s in p.slots], f, on_gpu)
                for p, f in zip(parts, fenced, strict=True)
            ]
            # The next bucket's turn must find this one's lane posts made. One part is
            # awaited inline below (gather_now), right after the turn is handed on: this
            # task goes on without yielding into the transport, which makes every lane's
            # post before its first await, and only then does the next bucket's task run.
            # Several parts under a gate are tasks made now, each making its posts in its
            # first step, scheduled before the next bucket's task is woken.
            waiting: Awaitable[list[list[BaseException | None] | BaseException]] = (
                gather_now(*posts)
                if turn is None or len(posts) == 1
                else asyncio.gather(*posts, return_exceptions=True)
            )
        except BaseException:
            if token is not None:
                POST_STAMPS.reset(token)
            raise
        finally:
            if turn is not None and not turn[1].done():
                turn[1].set_result(None)
        assert token is not None  # set once nothing before it raised
        try:
            outcomes = await waiting
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

    async def _handed(self, run: Run, bucket: int) -> None:
        """A gated bucket's posts wait until the bucket packed in its ring slot before it has
        handed over its slot's fences (every lane issued its last copy, the slot counter's
        write queued behind their events), or its post ended. Slot events are one per slot
        and lane, recorded again by each post: were this bucket's last copy on one lane
        issued (its slot's event recorded again) before the earlier bucket's last copy on
        another lane, the earlier bucket's counter write would wait for this bucket's
        copies, which wait (pack counter) for its packing, which waits for that counter.
        Ungated, a bucket is posted only once packed, after that counter: no such cycle."""
        earlier = run.ring.reuse[bucket] if run.gate is not None and run.ring.slots else -1
        before = run.handed.get(earlier) if earlier >= 0 else None
        if before is not None and not before.done():
            await before

    def _post_part(
        self,
        run: Run,
        bucket: int,
        p: Part,
        imms: list[int],
        fenced: Callable[[tuple[bytes, ...]], None] | None,
        gated: bool,
    ) -> Awaitable[list[BaseException | None]]:
        """One part's post: gated on the rank's pack counter (`gated`), fenced by slot
        events (`fenced`), both or neither."""
        key = self.slots.slot_key(run, bucket)
        if gated and run.gate is not None and isinstance(p.transport, GpuGating):
            fencing = (key, fenced) if fenced is not None else None
            return p.transport.post_gated(p.prepared, imms, run.gate.gate(bucket), fencing)
        if fenced is not None and isinstance(p.transport, SlotFencing):
            return p.transport.post_fenced(p.prepared, imms, key, fenced)
        return p.transport.post(p.prepared, imms)

    async def _post_in_place(self, run: Run, bucket: int) -> None:
        """A bucket the rank packed straight into its destinations' memory, on the GPU its
        staging is on, and whose bytes are visible there (it waited for its packing to
        finish before saying so): each write's immediate is delivered as its transport
        delivers those of its own writes, nothing is copied. Refused, failing the version,
        unless every write goes from staging to GPU memory of that same GPU through a
        transport that can deliver immediates so."""
        if run.gate is not None:
            raise TransferError(
                f"bucket {bucket} was said packed in place, but this version posts buckets "
                "before they are packed (a pack counter): its bytes may not be there yet"
            )
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
        self._landed(run, bucket, timed=False, slot=False)

    async def _post_delta(self, run: Run, bucket: int, sent: dict[int, int]) -> None:
        """A bucket some of whose destinations get a delta payload (deltas.bucket_writes),
        its writes prepared for this version only."""
        writes, payloads = bucket_writes(run.plan.buckets[bucket], sent, run.ring.shift[bucket])
        run.delta_bytes += payloads
        await self.post_writes(run, writes)
        self._landed(run, bucket, sent=sent)

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

    def _landed(
        self,
        run: Run,
        bucket: int,
        timed: bool = True,
        sent: dict[int, int] | None = None,
        slot: bool = True,
    ) -> None:
        """Every write of `bucket` landed: its time in the metrics (`timed`), its ring
        slot free (`RingSlots.slot_free`; not for a bucket packed in place, `slot` False:
        it used no slot, and no rank waits for one, so the rank is not sent a message per
        bucket while it packs), and its engines told (`on_landed`: they apply and checksum
        it while later buckets are on their way)."""
        landed = run.bucket_landed[bucket] = time.time()
        run.mark("first_landed")
        if timed and self.metrics is not None:
            self.metrics.bucket_landed(self.job, landed - run.bucket_posted[bucket])
        if slot:
            self.slots.slot_free(run, bucket)
        if self.on_landed is not None and not run.finished:
            self.on_landed(run, bucket, sent or {})
