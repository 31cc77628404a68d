"""A publisher's prepared writes: each write's route (transport, source, destination), and
a bucket's writes grouped by transport and prepared there once per plan, reused for every
version until a route changes. With a staging ring, once per (bucket, ring slot); the
plan's staging rings themselves, made once per plan."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.plan import RankPlan, StagingRing, WriteOp, staging_ring
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, Prepared, Transport, WriteRequest

from .runs import DELTA_OUT, Route, RouteKey, Run
from .seams import PickTransport

SourceRegion = Callable[[int], LocalRegion]
"""The rank's own registered region `id` (zero-copy sources); raises if it is not its."""
Grouped = list[tuple[Transport, list[tuple[WriteOp, WriteRequest]]]]
"""Writes and their requests, by the transport that carries them."""


@dataclass(frozen=True)
class Part:
    """A bucket's writes carried by one transport, prepared there."""

    transport: Transport
    prepared: Prepared
    slots: tuple[int, ...]  # each write's destination counter, in order
    nbytes: int
    replica: int = -1  # elastic jobs: the engine replica all its writes go to
    by_node: tuple[tuple[str, int], ...] = ()  # its bytes to each destination node


@dataclass(frozen=True)
class Cached:
    plan: RankPlan | str  # the plan prepared for (elastic: its replica's plan hash)
    routes: tuple[tuple[RouteKey, Route], ...]  # those the parts were prepared for
    parts: list[Part]


class PreparedWrites:
    """The routes of one trainer rank's writes and its prepared parts, for its plan."""

    def __init__(self, pick: PickTransport, source_region: SourceRegion) -> None:
        self._pick = pick
        self._source_region = source_region
        self._regions: dict[tuple[str, int], RegionDescriptor] = {}
        self.cache: dict[tuple[int, int, str], Cached] = {}
        """Prepared parts by (bucket, ring slot, replica plan hash: "" when not elastic)."""
        self._rings: dict[int, StagingRing] = {}  # the plan's, by slots

    def use(self, plan: RankPlan | None) -> None:
        """A new plan (or none): nothing prepared for the old one is kept."""
        self._regions = {(r.node, r.id): r for r in plan.regions} if plan else {}
        self.cache.clear()
        self._rings.clear()

    def keep(self, plan: RankPlan, live: set[str]) -> None:
        """Elastic: the same packs, engine replicas gone or come; what was prepared for the
        replicas whose plan hash is in `live` is kept (and the staging rings: the packs
        are the same)."""
        self._regions = {(r.node, r.id): r for r in plan.regions}
        for key in [k for k in self.cache if k[2] not in live]:
            del self.cache[key]

    def ring(self, plan: RankPlan, slots: int) -> StagingRing:
        """The plan's staging ring of `slots` slots (0: the whole send)."""
        ring = self._rings.get(slots)
        if ring is None:
            if len(self._rings) >= 8:  # a rank that keeps changing its ring: keep a few
                self._rings.clear()
            ring = self._rings[slots] = staging_ring(plan, slots)
        return ring

    async def route(self, run: Run, key: RouteKey) -> Route:
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
            src = run.staging if src_region < 0 else self._source_region(src_region)
        if src is None:
            raise WeightwireError("the plan writes from staging, and this rank has none")
        route = run.routes[key] = (await self._pick(dst_node, src, dst), src, dst)
        return route

    async def grouped(
        self,
        run: Run,
        writes: Iterable[WriteOp],
        shift: int = 0,
        routes: dict[RouteKey, Route] | None = None,
    ) -> Grouped:
        """`writes` as requests, by transport; staging writes read `shift` bytes further
        (their bucket's ring slot). `routes`: given, filled with the routes used."""
        groups: dict[Transport, list[tuple[WriteOp, WriteRequest]]] = {}
        for w in writes:
            key = (w.src_region, w.dst_node, w.dst_region)
            route = await self.route(run, key)
            if routes is not None:
                routes[key] = route
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
        return list(groups.items())

    async def parts(
        self,
        run: Run,
        bucket: int,
        part_key: str,
        prepared_for: RankPlan | str,
        writes: tuple[WriteOp, ...],
        replica: int,
    ) -> list[Part]:
        """The bucket's `writes` (those to engine replica `replica`, or all: -1) prepared on
        their transports: once per plan (`prepared_for`), again only when a route's
        transport, source or destination region is not the one prepared for."""
        slot, shift = run.ring.slot[bucket], run.ring.shift[bucket]
        cached = self.cache.get((bucket, slot, part_key))
        same = cached is not None and (
            cached.plan is prepared_for
            or (isinstance(prepared_for, str) and cached.plan == prepared_for)
        )
        if cached is not None and same:
            for key, route in cached.routes:
                now = run.routes.get(key) or await self.route(run, key)  # resolved: no await
                if now[0] is not route[0] or now[1] is not route[1] or now[2] is not route[2]:
                    break
            else:
                return cached.parts
        routes: dict[RouteKey, Route] = {}
        groups = await self.grouped(run, writes, shift, routes)
        parts = [
            Part(
                transport,
                transport.prepare([req for _, req in items]),
                tuple(w.slot for w, _ in items),
                sum(w.nbytes for w, _ in items),
                replica,
                by_node(w for w, _ in items),
            )
            for transport, items in groups
        ]
        self.cache[(bucket, slot, part_key)] = Cached(prepared_for, tuple(routes.items()), parts)
        return parts


def by_node(writes: Iterable[WriteOp]) -> tuple[tuple[str, int], ...]:
    """Bytes to each destination node (a part's, once when it is prepared)."""
    out: dict[str, int] = {}
    for w in writes:
        out[w.dst_node] = out.get(w.dst_node, 0) + w.nbytes
    return tuple(out.items())
