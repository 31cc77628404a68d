"""This node's part of the plans: advertising its ranks, installing and withdrawing
plans, and the per-rank facts (slots, lanes) that go into them."""

from __future__ import annotations

import time

import msgspec
import structlog

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.peer import (
    Advertise,
    RankAdvert,
)
from weightwire.protocol.plan import MAX_SLOTS, NodePlan, RankPlan
from weightwire.transport.tcp.auth import scoped

from . import heap
from .peers import COORDINATOR
from .sessions import Session

log = structlog.get_logger("weightwire.daemon")


class PlanKeeping:
    """Advertisements out, plans in (mixed into Daemon)."""

    def advertise(self, job: str) -> None:
        ranks: list[RankAdvert] = []
        for s in sorted(self.local.sessions.values(), key=lambda s: (s.role, s.rank)):
            if s.job != job:
                continue
            if s.role == "trainer" and s.sources:
                ranks.append(
                    RankAdvert(
                        role="trainer",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        sources=tuple(s.sources.values()),
                        lanes=self._lanes(s),
                    )
                )
            elif s.role == "engine" and s.destinations:
                ranks.append(
                    RankAdvert(
                        role="engine",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        destinations=tuple(s.destinations.values()),
                        layout=s.layout,
                        regions=tuple(r.descriptor for r in self.registry.of_session(s.id)),
                        slot=self._slot(s.job, s.rank),
                        lanes=self._lanes(s),
                        delta_region=next(
                            (
                                r.local.id
                                for r in self.registry.of_session(s.id)
                                if r.purpose == "delta"
                            ),
                            -1,
                        ),
                        replica=s.hello.replica,
                        replica_size=s.hello.replica_size,
                    )
                )
        self.advert_seq += 1
        self.mesh.send_soon(
            self.coordinator_name or COORDINATOR,
            Advertise(
                node=self.node,
                incarnation=self.incarnation,
                job=job,
                ranks=tuple(ranks),
                seq=self.advert_seq,
                plan_hash=self.plans[job].plan_hash if job in self.plans else "",
            ),
        )

    def _lanes(self, session: Session) -> int:
        """How many paths (NICs) this node's data planes have for the rank's memory."""
        return max(t.lanes(session.hello.device_uuid) for t in self.transports)

    def _slot(self, job: str, rank: int) -> int:
        """The immediate counter of an engine rank here: stable while its session lives."""
        key = (job, rank)
        if key not in self.slots:
            used = set(self.slots.values())
            self.slots[key] = next(i for i in range(MAX_SLOTS) if i not in used)
        return self.slots[key]

    def install_plan(self, plan: NodePlan) -> None:
        plan = _scoped(plan)
        old = self.plans.get(plan.job)
        self.plans[plan.job] = plan
        self.plan_problems.pop(plan.job, None)
        for rp in plan.sends:
            pub = self.publishers.get((plan.job, rp.rank))
            if pub is not None:
                pub.set_plan(rp)
        self.completions.install(plan.job, plan.plan_hash, plan.expects)
        self.grant_writers()
        related = self._nodes_of(plan)
        now = time.monotonic()
        everyone = set[str]().union(*map(self._nodes_of, self.plans.values()))
        self.related_since = {n: self.related_since.get(n, now) for n in everyone}
        for node in related - {self.node}:
            self._spawn(self._connect_quietly(node))
        if old is None or old.plan_hash != plan.plan_hash:
            log.info(
                "plan installed",
                job=plan.job,
                plan=plan.plan_hash,
                trainer_ranks=[s.rank for s in plan.sends],
                engine_ranks=[e.rank for e in plan.expects],
                heap_settle_s=round(heap.settle(), 4),
            )
        for fut in self.plan_waiters.pop(plan.job, []):
            if not fut.done():
                fut.set_result(None)

    def _plan_problem(self, job: str, err: PlanError) -> None:
        self.plans.pop(job, None)
        self.plan_problems[job] = err
        self.completions.drop_job(job, err.message)
        self.grant_writers()
        for fut in self.plan_waiters.pop(job, []):
            if not fut.done():
                fut.set_exception(err)

    def grant_writers(self) -> None:
        """Tell the transports who may write into each region of this node: an engine
        rank's regions the nodes its job's plan names as the rank's sources, with the
        plan's keys; every other region (staging, no plan) nobody."""
        sessions = {s.id: s for s in self.local.sessions.values()}
        for region in self.registry.regions.values():
            writers: frozenset[str] = frozenset()
            scope = ""
            s = sessions.get(region.session)
            plan = self.plans.get(s.job) if s is not None and s.role == "engine" else None
            if s is not None and plan is not None:
                for e in plan.expects:
                    if e.rank == s.rank:
                        # elastic jobs: the replica's plan, which its writers scope by too
                        writers, scope = frozenset(e.sources), e.plan_hash or plan.plan_hash
            for t in self.transports:
                t.authorize(region.local.id, writers, scope)

    @staticmethod
    def _elastic_engine_node(plan: NodePlan, node: str) -> bool:
        """`node` only hosts engine replicas of this (elastic) plan: losing it drops them."""
        replica_node = any(node in p.nodes for s in plan.sends for p in s.replicas)
        return replica_node and not any(node in e.sources for e in plan.expects)

    @staticmethod
    def _nodes_of(plan: NodePlan) -> set[str]:
        nodes = {r.node for s in plan.sends for r in s.regions}
        return nodes | {n for e in plan.expects for n in e.sources}

    def _withdraw(self, job: str, reason: str) -> None:
        """Stop using a job's plan (it involves a lost node) until the coordinator sends one.
        A version in flight fails with PEER_LOST: the peer is the cause, not the plan."""
        plan = self.plans.pop(job, None)
        if plan is None:
            return
        log.warning("plan withdrawn", job=job, plan=plan.plan_hash, reason=reason)
        self.grant_writers()
        for (j, _), pub in self.publishers.items():
            if j == job:
                pub.set_plan(None, reason, ErrorCode.PEER_LOST)
        self.advertise(job)


def _scoped(plan: NodePlan) -> NodePlan:
    """The plan with its destinations' tcp keys rotated for it (`auth.plan_rkey`): by the
    plan's hash, or in an elastic job by the hash of the replica on the region's node (what
    that node's engine ranks expect, `Expect.plan_hash`)."""

    def scope(rp: RankPlan, node: str) -> str:
        for part in rp.replicas:
            if node in part.nodes:
                return part.plan_hash
        return plan.plan_hash

    sends = tuple(
        msgspec.structs.replace(rp, regions=tuple(scoped(r, scope(rp, r.node)) for r in rp.regions))
        for rp in plan.sends
    )
    return msgspec.structs.replace(plan, sends=sends)
