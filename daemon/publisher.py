"""The source side: one trainer rank's versions, bucket by bucket, each on its own.

A rank's publish never waits for another rank. Bucket b's writes are posted the
moment the rank says it is packed; the rank is told when every write of the version
has landed, or the first cause of failure. A rank that packs into a ring of staging slots
is also told as each bucket's writes have all finished (its slot is free again).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import structlog

from weightwire.memory.cudadrv import CudaError
from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    PlanError,
    TransferError,
    VersionError,
    WeightwireError,
)
from weightwire.protocol.local import (
    BucketsIssued,
    BucketsLanded,
    PublishResult,
    ReplicaOutcome,
    Verdict,
)
from weightwire.protocol.plan import (
    DeltaSlot,
    RankPlan,
    StagingRing,
    WriteOp,
    encode_imm,
    staging_ring,
)
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import (
    CudaEvents,
    LocalRegion,
    Prepared,
    SlotFencing,
    Transport,
    WriteRequest,
)

from .metrics import Recorder
from .slotfence import Counters, MakeCounters, SlotCounters
from .versionlog import gbyte_s

log = structlog.get_logger("weightwire.daemon.publisher")

PickTransport = Callable[[str, LocalRegion, RegionDescriptor], Awaitable[Transport]]
"""Returns a connected transport to a node that carries src -> dst (connecting if needed)."""


DELTA_OUT = -2  # a write's src_region: the rank's delta-out region (payloads, trailers)
RouteKey = tuple[int, str, int]
"""(source region, destination node, destination region) of a write."""
Route = tuple[Transport, LocalRegion, RegionDescriptor]


@dataclass(frozen=True)
class _Part:
    """A bucket's writes carried by one transport, prepared there."""

    transport: Transport
    prepared: Prepared
    slots: tuple[int, ...]  # each write's destination counter, in order
    nbytes: int
    replica: int = -1  # elastic jobs: the engine replica all its writes go to
    by_node: tuple[tuple[str, int], ...] = ()  # its bytes to each destination node


@dataclass(frozen=True)
class _Cached:
    plan: RankPlan | str  # the plan prepared for (elastic: its replica's plan hash)
    routes: tuple[tuple[RouteKey, Route], ...]  # those the parts were prepared for
    parts: list[_Part]


@dataclass
class Run:
    """One attempt at one version."""

    version: int
    plan: RankPlan
    staging: LocalRegion | None
    ring: StagingRing
    delta_out: LocalRegion | None = None  # payloads and trailers (src_region DELTA_OUT)
    slot_events: bool = False  # the rank waits for slots on the GPU (`BucketsIssued`)
    issued: int = 0  # buckets reported `BucketsIssued`, or their counters written on the GPU
    counters: Counters | None = None  # the rank waits for slots on the GPU, on these
    on_gpu: set[int] = field(default_factory=set)  # buckets whose counter the GPU writes
    posted: set[int] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    first_post: float = 0.0
    bucket_posted: dict[int, float] = field(default_factory=dict)  # wall clock
    bucket_landed: dict[int, float] = field(default_factory=dict)
    routes: dict[RouteKey, Route] = field(default_factory=dict)
    bytes_done: int = 0
    writes_done: int = 0
    peer_bytes: dict[str, int] = field(default_factory=dict)  # landed, by destination node
    error: WeightwireError | None = None
    finished: bool = False
    trailers_posted: bool = False
    delta_bytes: int = 0
    verdicts: dict[tuple[str, int], Verdict] = field(default_factory=dict)
    landed: bool = False  # every write landed; a delta-capable plan then awaits the verdicts
    dropped: dict[int, WeightwireError] = field(default_factory=dict)  # elastic: replica -> why

    def replica_nodes(self, replica: int) -> set[str]:
        return {n for p in self.plan.replicas if p.replica == replica for n in p.nodes}

    def outcomes(self) -> tuple[ReplicaOutcome, ...]:
        return tuple(
            ReplicaOutcome(replica=p.replica, ok=True)
            if p.replica not in self.dropped
            else ReplicaOutcome(
                replica=p.replica,
                ok=False,
                code=self.dropped[p.replica].code.value,
                message=self.dropped[p.replica].message,
            )
            for p in self.plan.replicas
        )


@dataclass
class Publisher:
    job: str
    rank: int
    pick: PickTransport
    reply: Callable[[PublishResult | BucketsLanded | BucketsIssued], None]
    announce: Callable[[int, str, str, set[str]], None]
    """announce(version, "start"|"abort", message, destination nodes)."""
    source_region: Callable[[int], LocalRegion]
    """The rank's own registered region `id` (zero-copy sources); raises if it is not its."""
    metrics: Recorder | None = None
    """Told of each landed bucket and each finished version (never per write)."""
    plan: RankPlan | None = None
    staging: LocalRegion | None = None
    delta_out: LocalRegion | None = None  # where the rank encodes payloads and trailers
    last_version: int = -1
    run: Run | None = None
    previous: Run | None = None  # the last run of an earlier session of this rank
    _regions: dict[tuple[str, int], RegionDescriptor] = field(default_factory=dict)
    _cache: dict[tuple[int, int, str], _Cached] = field(default_factory=dict)
    """Prepared parts by (bucket, ring slot, replica plan hash: "" when not elastic)."""
    _rings: dict[int, StagingRing] = field(default_factory=dict)  # this plan's, by slots
    make_counters: MakeCounters = SlotCounters  # a version's GPU slot counters

    def set_plan(
        self, plan: RankPlan | None, reason: str = "", code: ErrorCode = ErrorCode.PLAN_CHANGED
    ) -> None:
        """A new plan, or None: the plan was withdrawn (`code` PEER_LOST: a node it involves
        was lost, and a version in flight fails with that, as any lost peer's does)."""
        running = self.run is not None and not self.run.finished
        new_hash = plan.plan_hash if plan is not None else None
        old = self.plan
        if (
            plan is not None
            and old is not None
            and plan.replicas
            and old.replicas
            and new_hash == old.plan_hash
        ):
            self._replicas_changed(plan)
            return
        if running and self.plan is not None and new_hash != self.plan.plan_hash:
            why = reason or "the plan changed mid-version"
            self._fail(WeightwireError(why, code=code))
        self.plan = plan
        self._regions = {(r.node, r.id): r for r in plan.regions} if plan else {}
        self._cache.clear()
        self._rings.clear()

    def _replicas_changed(self, plan: RankPlan) -> None:
        """Elastic: the same packs, engine replicas gone or come. A running version keeps
        its own plan (a replica that joins gets the next version) and drops the replicas
        that left; what was prepared for the replicas that stay is kept."""
        live = {p.plan_hash for p in plan.replicas}
        run = self.run
        if run is not None and not run.finished:
            for p in run.plan.replicas:
                if p.plan_hash not in live:
                    self._drop(
                        run,
                        p.replica,
                        PeerLostError(f"engine replica {p.replica} left the plan mid-version"),
                    )
        self.plan = plan
        self._regions = {(r.node, r.id): r for r in plan.regions}
        for key in [k for k in self._cache if k[2] not in live]:
            del self._cache[key]

    def drop_nodes(self, nodes: set[str], reason: str) -> bool:
        """Elastic: nodes of engine replicas were lost. The running version drops those
        replicas (the others go on); False when the plan is not elastic."""
        if self.plan is None or not self.plan.replicas:
            return False
        run = self.run
        if run is not None and not run.finished:
            for p in run.plan.replicas:
                if nodes & set(p.nodes):
                    self._drop(run, p.replica, PeerLostError(reason))
        return True

    def _drop(self, run: Run, replica: int, err: WeightwireError) -> None:
        """Engine replica `replica` gets no more of `run`'s version; the others go on. When
        none is left the version fails."""
        if run.finished or replica in run.dropped:
            return
        run.dropped[replica] = err
        log.warning(
            "replica dropped from version",
            rank=self.rank,
            version=run.version,
            replica=replica,
            code=err.code.value,
            error=err.message,
        )
        nodes = run.replica_nodes(replica)
        self.announce(run.version, "abort", f"[{err.code.value}] {err.message}", nodes)
        if all(p.replica in run.dropped for p in run.plan.replicas):
            self._fail(err, run)
        elif not run.tasks:
            run.landed = len(run.posted) == len(run.plan.buckets) and (
                run.trailers_posted or not run.plan.trailers
            )
            self._maybe_finish(run)

    def ring(self, slots: int) -> StagingRing:
        """The plan's staging ring of `slots` slots (0: the whole send)."""
        assert self.plan is not None
        ring = self._rings.get(slots)
        if ring is None:
            if len(self._rings) >= 8:  # a rank that keeps changing its ring: keep a few
                self._rings.clear()
            ring = self._rings[slots] = staging_ring(self.plan, slots)
        return ring

    @property
    def destinations(self) -> set[str]:
        return {r.node for r in self.plan.regions} if self.plan else set()

    def begin(
        self,
        version: int,
        plan_hash: str,
        staging_buckets: int = 0,
        slot_events: bool = False,
        fence_offset: int = -1,
        fence_base: int = 0,
    ) -> None:
        """`fence_offset` >= 0: the rank waits for ring slots on the GPU, on counters at
        that offset of its staging region (`BeginVersion.fence_offset`)."""
        if self.plan is None:
            raise PlanError("this rank has no plan yet", code=ErrorCode.NOT_READY)
        if plan_hash != self.plan.plan_hash:
            raise PlanError(
                f"publish used plan {plan_hash}, the current plan is {self.plan.plan_hash}",
                code=ErrorCode.PLAN_CHANGED,
            )
        if version <= self.last_version:
            raise VersionError(
                f"version {version} does not follow version {self.last_version} of trainer "
                f"rank {self.rank}: versions only go forwards"
            )
        ring = self.ring(staging_buckets)
        staging_ok = self.staging is not None and self.staging.length >= ring.nbytes
        if ring.nbytes and not staging_ok:
            slots = f" ({ring.slots} slots)" if ring.slots else ""
            raise PlanError(
                f"the plan needs a staging region of {ring.nbytes} bytes{slots}; "
                f"register one first",
                code=ErrorCode.NOT_READY,
            )
        out_ok = self.delta_out is not None and self.delta_out.length >= self.plan.delta_bytes
        if self.plan.delta_bytes and not out_ok:
            raise PlanError(
                f"the plan needs a delta-out region of {self.plan.delta_bytes} bytes; "
                f"register one first (purpose delta)",
                code=ErrorCode.NOT_READY,
            )
        for run in (self.previous, self.run):
            if run is not None and run.tasks:
                raise VersionError(
                    f"version {run.version} still has writes in flight", code=ErrorCode.NOT_READY
                )
        counters = None
        if fence_offset >= 0:
            counters = self.make_counters(
                self.staging, ring, fence_offset, fence_base, len(self.plan.buckets)
            )
        self.last_version = version
        self.run = Run(
            version=version,
            plan=self.plan,
            staging=self.staging,
            ring=ring,
            delta_out=self.delta_out,
            slot_events=slot_events and ring.slots > 0 and counters is None,
            counters=counters,
        )
        self.announce(version, "start", "", self.destinations)
        if not self.plan.buckets and not self.plan.trailers:
            self._finish(self.run)

    def bucket_ready(
        self,
        version: int,
        buckets: tuple[int, ...],
        delta: tuple[tuple[int, int, int], ...] = (),
        in_place: tuple[int, ...] = (),
    ) -> None:
        """Buckets of `version` packed by the rank: their writes are posted together.
        `delta`: (bucket, delta slot, payload bytes) of those sent as delta payloads.
        `in_place`: those the rank packed straight into their destinations (colocated):
        only their immediates are delivered (`_post_in_place`)."""
        run = self.run
        if run is not None and version < run.version:
            raise VersionError(
                f"bucket {buckets[0]} of version {version}, older than version {run.version} "
                f"being published"
            )
        if run is None or run.version != version:
            raise VersionError(
                f"bucket {buckets[0]} of version {version}, which was never begun "
                f"(BeginVersion first)",
                code=ErrorCode.INVALID,
            )
        if run.finished:
            return  # the version already failed; the rank learns why from PublishResult
        for bucket in buckets:
            if not 0 <= bucket < len(run.plan.buckets):
                raise VersionError(
                    f"bucket {bucket} does not exist (the plan has {len(run.plan.buckets)})",
                    code=ErrorCode.INVALID,
                )
        for i, bucket in enumerate(buckets):
            if bucket in run.posted or bucket in buckets[:i]:
                raise VersionError(
                    f"bucket {bucket} of version {version} was already posted",
                    code=ErrorCode.DUPLICATE,
                )
        sent = self._check_delta(run, buckets, delta)
        direct = set(in_place)
        if not direct <= set(buckets) or direct & set(sent):
            raise VersionError(
                f"buckets {sorted(direct)} said packed in place are not all posted now, or "
                f"also sent as delta payloads",
                code=ErrorCode.INVALID,
            )
        run.posted.update(buckets)
        if not run.first_post:
            run.first_post = time.monotonic()
        now = time.time()
        for bucket in buckets:
            run.bucket_posted[bucket] = now
        with structlog.contextvars.bound_contextvars(rank=self.rank, version=version):
            task = asyncio.get_running_loop().create_task(self._post(run, buckets, sent, direct))
        run.tasks.add(task)
        task.add_done_callback(functools.partial(self._written, run))

    def _check_delta(
        self, run: Run, buckets: tuple[int, ...], delta: tuple[tuple[int, int, int], ...]
    ) -> dict[int, dict[int, int]]:
        """bucket -> {delta slot: payload bytes}, checked against the plan."""
        sent: dict[int, dict[int, int]] = {}
        for bucket, index, nbytes in delta:
            if bucket not in buckets or not 0 <= index < len(run.plan.buckets[bucket].deltas):
                raise VersionError(
                    f"delta payload for slot {index} of bucket {bucket}, which the plan does "
                    f"not have or which is not posted now",
                    code=ErrorCode.INVALID,
                )
            ds = run.plan.buckets[bucket].deltas[index]
            if not len(ds.writes) <= nbytes <= ds.capacity or index in sent.get(bucket, {}):
                raise VersionError(
                    f"delta payload of {nbytes} bytes for slot {index} of bucket {bucket} "
                    f"(room {ds.capacity}, at least {len(ds.writes)}), or given twice",
                    code=ErrorCode.INVALID,
                )
            sent.setdefault(bucket, {})[index] = nbytes
        return sent

    def trailers_ready(self, version: int, lengths: tuple[int, ...]) -> None:
        """The rank's trailers of `version` are in staging: post them (its last writes)."""
        run = self.run
        if run is None or run.version != version:
            raise VersionError(f"trailers of version {version}, which was not begun")
        if run.finished:
            return
        trailers = run.plan.trailers
        if run.trailers_posted or len(lengths) != len(trailers):
            raise VersionError(
                f"{len(lengths)} trailers for a plan with {len(trailers)}, or posted twice",
                code=ErrorCode.INVALID,
            )
        for t, n in zip(trailers, lengths, strict=True):
            if not 0 < n <= t.capacity:
                raise VersionError(
                    f"a trailer of {n} bytes for a slot of {t.capacity}", code=ErrorCode.INVALID
                )
        run.trailers_posted = True
        writes = [
            WriteOp(
                src_offset=t.src_offset,
                src_region=DELTA_OUT,
                length=n,
                dst_node=t.dst_node,
                dst_region=t.dst_region,
                dst_offset=t.dst_offset,
                slot=t.slot,
                dst_rank=t.dst_rank,
            )
            for t, n in zip(trailers, lengths, strict=True)
        ]
        run.delta_bytes += sum(lengths)
        task = asyncio.get_running_loop().create_task(self._post_writes(run, writes))
        run.tasks.add(task)
        task.add_done_callback(functools.partial(self._written, run))

    def on_verdict(self, version: int, verdict: Verdict) -> None:
        """An engine rank's outcome of `version` (delta-capable plans)."""
        run = self.run
        if run is None or run.version != version or run.finished:
            return
        if not any((t.dst_node, t.slot) == (verdict.node, verdict.slot) for t in run.plan.trailers):
            return
        run.verdicts[(verdict.node, verdict.slot)] = verdict
        self._maybe_finish(run)

    def _maybe_finish(self, run: Run) -> None:
        """Finish once every write landed and every engine rank gave its verdict; fail as
        soon as one failed the version and no write of it is in flight."""
        if run.finished or run.tasks:
            return
        bad = [v for v in run.verdicts.values() if not v.ok]
        if bad:
            err = WeightwireError(
                "; ".join(f"engine rank {v.rank} on {v.node}: {v.message}" for v in bad),
                code=_code(bad[0].code),
            )
            self._fail(err, run, announce=False)
        elif run.landed and len(run.verdicts) >= len(run.plan.trailers):
            self._finish(run)

    async def _route(self, run: Run, key: RouteKey) -> Route:
        """The transport, source and destination of writes from region key[0] to region
        key[2] of node key[1]; resolved once per run."""
        route = run.routes.get(key)
        if route is not None:
            return route
        src_region, dst_node, dst_region = key
        dst = self._regions.get((dst_node, dst_region))
        if dst is None:
            raise WeightwireError(f"plan names region {dst_region} of {dst_node}, not advertised")
        if src_region == DELTA_OUT:
            src = run.delta_out
        else:
            src = run.staging if src_region < 0 else self.source_region(src_region)
        if src is None:
            raise WeightwireError("the plan writes from staging, and this rank has none")
        route = run.routes[key] = (await self.pick(dst_node, src, dst), src, dst)
        return route

    async def _prepared(self, run: Run, bucket: int) -> list[_Part]:
        """The bucket's writes prepared on their transports: once per plan, again only when
        a route's transport, source or destination region is not the one prepared for. With
        a staging ring, per (bucket, slot): its staging writes read from the bucket's slot."""
        writes = run.plan.buckets[bucket].writes
        if not run.plan.replicas:
            return await self._prepared_part(run, bucket, "", run.plan, writes, -1)
        parts: list[_Part] = []
        for p in run.plan.replicas:
            if p.replica in run.dropped:
                continue
            ranks = set(p.ranks)
            mine = tuple(w for w in writes if w.dst_rank in ranks)
            h = p.plan_hash
            try:
                parts += await self._prepared_part(run, bucket, h, h, mine, p.replica)
            except WeightwireError as exc:  # its node cannot be reached: that replica only
                self._drop(run, p.replica, exc)
        return parts

    async def _prepared_part(
        self,
        run: Run,
        bucket: int,
        part_key: str,
        prepared_for: RankPlan | str,
        writes: tuple[WriteOp, ...],
        replica: int,
    ) -> list[_Part]:
        slot, shift = run.ring.slot[bucket], run.ring.shift[bucket]
        cached = self._cache.get((bucket, slot, part_key))
        same = cached is not None and (
            cached.plan is prepared_for
            or (isinstance(prepared_for, str) and cached.plan == prepared_for)
        )
        if cached is not None and same:
            for key, route in cached.routes:
                now = await self._route(run, key)
                if any(a is not b for a, b in zip(now, route, strict=True)):
                    break
            else:
                return cached.parts
        groups: dict[Transport, list[tuple[WriteOp, WriteRequest]]] = {}
        routes: dict[RouteKey, Route] = {}
        for w in writes:
            key = (w.src_region, w.dst_node, w.dst_region)
            route = routes[key] = await self._route(run, key)
            transport, src, dst = route
            req = WriteRequest(
                src,
                w.src_offset + shift if w.src_region < 0 else w.src_offset,
                dst,
                w.dst_offset,
                w.length,
                None,
                w.lane,
                w.count,
                w.src_stride,
                w.dst_stride,
            )
            groups.setdefault(transport, []).append((w, req))
        parts = [
            _Part(
                transport,
                transport.prepare([req for _, req in items]),
                tuple(w.slot for w, _ in items),
                sum(w.nbytes for w, _ in items),
                replica,
                _by_node(w for w, _ in items),
            )
            for transport, items in groups.items()
        ]
        self._cache[(bucket, slot, part_key)] = _Cached(prepared_for, tuple(routes.items()), parts)
        return parts

    async def _post(
        self,
        run: Run,
        buckets: tuple[int, ...],
        sent: dict[int, dict[int, int]],
        in_place: set[int],
    ) -> None:
        """All writes of some buckets; the first failure fails the run, once every write
        of them has finished (none may still read staging when the rank is told)."""
        outcomes = await asyncio.gather(
            *(
                self._post_delta(run, b, sent[b])
                if b in sent
                else self._post_in_place(run, b)
                if b in in_place
                else self._post_bucket(run, b)
                for b in buckets
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _post_bucket(self, run: Run, bucket: int) -> None:
        parts = await self._prepared(run, bucket)
        if run.finished:  # failed meanwhile: nothing more of it is sent
            raise run.error or WeightwireError("the version already failed", code=ErrorCode.ABORTED)
        parts = [p for p in parts if p.replica not in run.dropped]
        high = encode_imm(run.version, 0)
        fenced = self._fencing(run, bucket, parts)
        outcomes = await asyncio.gather(
            *(
                p.transport.post_fenced(
                    p.prepared, [high | s for s in p.slots], self._slot_key(run, bucket), f
                )
                if f is not None and isinstance(p.transport, SlotFencing)
                else p.transport.post(p.prepared, [high | s for s in p.slots])
                for p, f in zip(parts, fenced, strict=True)
            ),
            return_exceptions=True,
        )
        first: BaseException | None = None
        for part, results in zip(parts, outcomes, strict=True):
            err: BaseException | None = (
                results
                if isinstance(results, BaseException)
                else next((e for e in results if e is not None), None)
            )
            if err is not None and part.replica >= 0 and isinstance(err, WeightwireError):
                self._drop(run, part.replica, err)  # that replica only: the others go on
                continue
            if err is not None:
                first = first or err
                continue
            assert not isinstance(results, BaseException)
            run.bytes_done += part.nbytes
            run.writes_done += len(part.slots)
            for node, n in part.by_node:
                run.peer_bytes[node] = run.peer_bytes.get(node, 0) + n
        if first is not None:
            raise first
        landed = run.bucket_landed[bucket] = time.time()
        if self.metrics is not None:
            self.metrics.bucket_landed(self.job, landed - run.bucket_posted[bucket])
        self._slot_free(run, bucket)

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
            transport, src, dst = await self._route(run, (w.src_region, w.dst_node, w.dst_region))
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
        run.bucket_landed[bucket] = time.time()
        self._slot_free(run, bucket)

    def _slot_free(self, run: Run, bucket: int) -> None:
        """Every write of `bucket` landed: its ring slot is free. The rank learns it from
        `BucketsLanded`, or from its slot counter where it waits on the GPU (written here
        unless its copies' events wrote it already)."""
        if not run.ring.slots or run.finished:
            return
        if run.counters is None:
            self.reply(BucketsLanded(version=run.version, buckets=(bucket,)))
            return
        if bucket in run.on_gpu:
            return  # written on the GPU behind its copies already
        try:
            run.counters.signal(bucket)
        except CudaError as exc:
            self._fail(TransferError(f"slot counter of bucket {bucket}: {exc.message}"), run)

    def _slot_key(self, run: Run, bucket: int) -> tuple[str, int, int]:
        return (self.job, self.rank, run.ring.slot[bucket])

    def _fencing(
        self, run: Run, bucket: int, parts: list[_Part]
    ) -> list[Callable[[tuple[bytes, ...]], None] | None]:
        """Per part, what its transport calls once the part's copies are all issued, where
        the rank waits for slots on the GPU and every part is on a transport that fences
        (cuda); the last one tells the rank `BucketsIssued` with every part's events.
        Otherwise None each: the rank waits for the landing."""
        if not (run.slot_events or run.counters) or not parts:
            return [None] * len(parts)
        if not all(isinstance(p.transport, SlotFencing) for p in parts):
            return [None] * len(parts)
        events: list[bytes] = []
        left = [len(parts)]

        def issued(handles: tuple[bytes, ...]) -> None:
            events.extend(handles)
            left[0] -= 1
            if not left[0] and not run.finished and run.counters is not None:
                self._signal_issued(run, bucket, parts, tuple(dict.fromkeys(events)))
            elif not left[0] and not run.finished:
                run.issued += 1
                self.reply(
                    BucketsIssued(
                        version=run.version,
                        buckets=(bucket,),
                        events=tuple(dict.fromkeys(events)),
                    )
                )

        return [issued] * len(parts)

    def _signal_issued(
        self, run: Run, bucket: int, parts: list[_Part], handles: tuple[bytes, ...]
    ) -> None:
        """Every cuda copy of `bucket` is queued: its slot counter is written on the GPU
        once the copies' events are (left to the landing if the events are not known)."""
        assert run.counters is not None
        transport = parts[0].transport
        events = transport.events_of(handles) if isinstance(transport, CudaEvents) else None
        if events is None:
            return
        try:
            run.counters.signal(bucket, events)
        except CudaError as exc:  # the landing writes it
            log.warning("slot counter not written on the GPU", bucket=bucket, error=exc.message)
            return
        run.on_gpu.add(bucket)
        run.issued += 1

    async def _post_delta(self, run: Run, bucket: int, sent: dict[int, int]) -> None:
        """A bucket some of whose destinations get a delta payload: each payload travels as
        many writes (consecutive parts of it) as the dense writes it replaces, into that
        engine's delta area; the other writes go as planned."""
        b = run.plan.buckets[bucket]
        replaced: set[int] = set()
        writes: list[WriteOp] = []
        for index, nbytes in sorted(sent.items()):
            ds = b.deltas[index]
            replaced.update(ds.writes)
            writes += _payload_writes(ds, nbytes)
            run.delta_bytes += nbytes
        shift = run.ring.shift[bucket]  # staging writes read from the bucket's ring slot
        writes += [
            msgspec.structs.replace(w, src_offset=w.src_offset + shift) if w.src_region == -1 else w
            for i, w in enumerate(b.writes)
            if i not in replaced
        ]
        await self._post_writes(run, writes)
        landed = run.bucket_landed[bucket] = time.time()
        if self.metrics is not None:
            self.metrics.bucket_landed(self.job, landed - run.bucket_posted[bucket])
        self._slot_free(run, bucket)

    async def _post_writes(self, run: Run, writes: list[WriteOp]) -> None:
        """Writes made for this version only (prepared now, not cached)."""
        groups: dict[Transport, list[tuple[WriteOp, WriteRequest]]] = {}
        for w in writes:
            transport, src, dst = await self._route(run, (w.src_region, w.dst_node, w.dst_region))
            req = WriteRequest(
                src, w.src_offset, dst, w.dst_offset, w.length, None, w.lane, w.count,
                w.src_stride, w.dst_stride,
            )  # fmt: skip
            groups.setdefault(transport, []).append((w, req))
        high = encode_imm(run.version, 0)
        parts = list(groups.items())
        outcomes = await asyncio.gather(
            *(
                t.post(t.prepare([r for _, r in items]), [high | w.slot for w, _ in items])
                for t, items in parts
            )
        )
        for (_, items), results in zip(parts, outcomes, strict=True):
            if any(results):
                raise next(e for e in results if e is not None)
            run.bytes_done += sum(w.nbytes for w, _ in items)
            run.writes_done += len(items)
            for w, _ in items:
                run.peer_bytes[w.dst_node] = run.peer_bytes.get(w.dst_node, 0) + w.nbytes

    def _written(self, run: Run, task: asyncio.Task[None]) -> None:
        run.tasks.discard(task)
        if task.cancelled():
            exc: BaseException | None = WeightwireError("write cancelled", code=ErrorCode.ABORTED)
        else:
            exc = task.exception()
        if exc is not None and not run.finished:
            err = exc if isinstance(exc, WeightwireError) else TransferError(repr(exc))
            self._fail(err, run)
        elif not run.finished and not run.tasks:
            run.landed = len(run.posted) == len(run.plan.buckets) and (
                run.trailers_posted or not run.plan.trailers
            )
            self._maybe_finish(run)

    def _finish(self, run: Run) -> None:
        run.finished = True
        now = time.monotonic()
        seconds = now - run.started
        transfer = now - run.first_post if run.first_post else 0.0
        log.debug(
            "publish complete",
            rank=self.rank,
            version=run.version,
            bytes=run.bytes_done,
            writes=run.writes_done,
            seconds=round(seconds, 6),
            gbyte_s=gbyte_s(run.bytes_done, seconds),
            staging_buckets=run.ring.slots,
        )
        self._record(run, seconds, None)
        self.reply(
            PublishResult(
                version=run.version,
                ok=True,
                nbytes=run.bytes_done,
                writes=run.writes_done,
                seconds=seconds,
                transfer_seconds=transfer,
                buckets=tuple(
                    (run.bucket_posted[b], run.bucket_landed.get(b, 0.0))
                    for b in range(len(run.plan.buckets))
                ),
                verdicts=tuple(run.verdicts.values()),
                delta_bytes=run.delta_bytes,
                replicas=run.outcomes(),
            )
        )

    def _record(self, run: Run, seconds: float, code: str | None) -> None:
        """The rank's finished version in the metrics (code None: it landed)."""
        if self.metrics is not None:
            self.metrics.rank_version(
                self.job, "trainer", self.rank, run.version, run.bytes_done, seconds,
                run.peer_bytes, code,
            )  # fmt: skip

    def abort(self, reason: str, code: ErrorCode = ErrorCode.ABORTED) -> None:
        self._fail(WeightwireError(reason, code=code))

    def _fail(self, err: WeightwireError, run: Run | None = None, *, announce: bool = True) -> None:
        """`announce`: tell the destinations to fail the version (not when they are the
        ones that failed it)."""
        run = run or self.run
        if run is None or run.finished:
            return
        run.finished = True
        run.error = err
        self._release(run)
        log.warning(
            "publish failed",
            rank=self.rank,
            version=run.version,
            code=err.code.value,
            error=err.message,
            bytes=run.bytes_done,
        )
        if announce:
            message = f"[{err.code.value}] {err.message}"
            self.announce(run.version, "abort", message, self.destinations)
        seconds = time.monotonic() - run.started
        self._record(run, seconds, err.code.value)
        self.reply(
            PublishResult(
                version=run.version,
                ok=False,
                nbytes=run.bytes_done,
                writes=run.writes_done,
                seconds=seconds,
                code=err.code.value,
                message=err.message,
                verdicts=tuple(run.verdicts.values()),
                delta_bytes=run.delta_bytes,
                replicas=run.outcomes(),
            )
        )

    def _release(self, run: Run) -> None:
        """A failed version: the rank's GPU waits on its slot counters all end."""
        if run.counters is None:
            return
        try:
            run.counters.release()
        except CudaError as exc:  # the rank releases them itself when it learns the outcome
            log.error("slot counters not released", version=run.version, error=exc.message)

    async def drain(self, timeout_s: float) -> None:
        """Wait for writes still in flight: a failed version's stragglers, or those of an
        earlier session of this rank, which must never land on top of a newer version."""
        tasks = set()
        for run in (self.previous, self.run):
            if run is not None:
                tasks |= run.tasks
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)  # returns at the timeout, no raise
        if self.previous is not None and not self.previous.tasks:
            self.previous = None

    def progress(self) -> dict[str, object]:
        run = self.run
        total = self.plan.write_bytes if self.plan else 0
        return {
            "rank": self.rank,
            "plan": self.plan.plan_hash if self.plan else None,
            "last_version": self.last_version,
            "version": run.version if run else None,
            "state": (
                "idle"
                if run is None
                else "failed"
                if run.error
                else "done"
                if run.finished
                else "writing"
            ),
            "bytes_done": run.bytes_done if run else 0,
            "bytes_total": total,
            "buckets_posted": len(run.posted) if run else 0,
            "buckets": len(self.plan.buckets) if self.plan else 0,
            "staging_buckets": run.ring.slots if run else 0,  # 0: the whole send is staged
            "staging_bytes": run.ring.nbytes if run else 0,
            "slot_events": run.slot_events if run else False,  # slots waited for on the GPU
            "slot_counters": run.counters is not None if run else False,  # waited for on
            # GPU counters the daemon writes (`buckets_issued`: those written on the GPU)
            "buckets_issued": run.issued if run else 0,  # of them, reported BucketsIssued
        }


def _payload_writes(ds: DeltaSlot, nbytes: int) -> list[WriteOp]:
    """A payload of `nbytes` at `ds.src_offset` as len(ds.writes) consecutive parts."""
    k = len(ds.writes)
    cuts = [nbytes * i // k for i in range(k + 1)]
    return [
        WriteOp(
            src_offset=ds.src_offset + cuts[i],
            src_region=DELTA_OUT,
            length=cuts[i + 1] - cuts[i],
            dst_node=ds.dst_node,
            dst_region=ds.dst_region,
            dst_offset=ds.dst_offset + cuts[i],
            slot=ds.slot,
            dst_rank=ds.dst_rank,
        )
        for i in range(k)
    ]


def _code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.TRANSFER


def _by_node(writes: Iterable[WriteOp]) -> tuple[tuple[str, int], ...]:
    """Bytes to each destination node (a part's, once when it is prepared)."""
    out: dict[str, int] = {}
    for w in writes:
        out[w.dst_node] = out.get(w.dst_node, 0) + w.nbytes
    return tuple(out.items())
