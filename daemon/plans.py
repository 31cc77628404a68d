"""This node's part of the plans: advertising its ranks, installing and withdrawing
plans, and the per-rank facts (slots, lanes) that go into them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping

import msgspec
import structlog

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.peer import Advertise, RankAdvert
from weightwire.protocol.plan import MAX_SLOTS, NodePlan, RankPlan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.tcp.auth import scoped

from . import heap
from .completions import Completions
from .peers import COORDINATOR
from .regions import RegionRegistry
from .seams import Authorize, Joining, PeerSend, PlanUser
from .sessions import Session

log = structlog.get_logger("weightwire.daemon")
_encoder = msgspec.msgpack.Encoder()


class PlanBook:
    """Advertisements out, plans in; owns the installed plans and the engine slots."""

    def __init__(
        self,
        node: str,
        incarnation: str,
        mesh: PeerSend,
        joining: Joining,
        sessions: Mapping[bytes, Session],
        registry: RegionRegistry,
        lanes: Callable[[str], int],
        completions: Completions,
        users: PlanUser,
        connect: Callable[[str], None],
        authorize: Authorize,
        plans: dict[str, NodePlan],
        max_bytes: int = 0,
        peer_regions: Callable[[Collection[RegionDescriptor]], None] | None = None,
    ) -> None:
        self.node = node
        self.incarnation = incarnation
        self._mesh = mesh
        self._joining = joining
        self._sessions = sessions
        self._registry = registry
        self._lanes = lanes
        self._completions = completions
        self._users = users
        self._connect = connect
        self._authorize = authorize
        self.plans = plans  # installed, by job (Publishing reads them)
        self.max_bytes = max_bytes  # the largest advert a daemon takes (0: unchecked)
        # told the regions of other nodes the plans name, whenever the plans change
        self._peer_regions = peer_regions
        self._too_large: set[str] = set()  # jobs whose advert did not fit: their problem
        self.problems: dict[str, PlanError] = {}
        self.withdrawn: dict[str, str] = {}  # jobs whose plan the coordinator withdrew: why
        self.rank_problems: dict[tuple[str, int], PlanError] = {}  # (job, engine rank) refused
        self.related_since: dict[str, float] = {}  # nodes of this node's plans: since when
        # waits for a job's plan to change (a dict: one that ends leaves in O(1))
        self._waiters: dict[str, dict[asyncio.Future[None], None]] = {}
        self._slots: dict[tuple[str, int], int] = {}  # engine ranks' immediate counters
        self._advert_seq = 0

    def advertise(self, job: str) -> None:
        ranks: list[RankAdvert] = []
        for s in sorted(self._sessions.values(), key=lambda s: (s.role, s.rank)):
            if s.job != job:
                continue
            if s.role == "trainer" and s.sources:
                ranks.append(
                    RankAdvert(
                        role="trainer",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        sources=tuple(s.sources.values()),
                        lanes=self._lanes(s.hello.device_uuid),
                    )
                )
            elif s.role == "engine" and s.destinations:
                regions = self._registry.of_session(s.id)
                ranks.append(
                    RankAdvert(
                        role="engine",
                        rank=s.rank,
                        world_size=s.hello.world_size,
                        destinations=tuple(s.destinations.values()),
                        layout=s.layout,
                        regions=tuple(r.descriptor for r in regions),
                        slot=self._slot(s.job, s.rank),
                        lanes=self._lanes(s.hello.device_uuid),
                        delta_region=next(
                            (r.local.id for r in regions if r.purpose == "delta"), -1
                        ),
                        replica=s.hello.replica,
                        replica_size=s.hello.replica_size,
                        replica_plan=self._replica_plan(job, s.rank)
                        if s.hello.replica >= 0
                        else "",
                    )
                )
        self._advert_seq += 1
        advert = Advertise(
            node=self.node,
            incarnation=self.incarnation,
            job=job,
            ranks=tuple(ranks),
            seq=self._advert_seq,
            plan_hash=self.plans[job].plan_hash if job in self.plans else "",
        )
        size = len(_encoder.encode(advert)) + 64 if self.max_bytes else 0  # + its tag frame
        if size > self.max_bytes > 0:
            # The coordinator would drop it ("bad peer message") and the job's ranks wait
            # for a plan to their timeout, told that more ranks are awaited. Withdraw this
            # node's ranks there instead (a stale advert must not be planned), and tell them.
            advert = msgspec.structs.replace(advert, ranks=())
            self._too_large.add(job)
            self.problem(
                job,
                PlanError(
                    f"the ranks of job {job!r} on {self.node} ({len(ranks)} ranks) advertise "
                    f"{size} bytes to the coordinator, more than max_message_bytes "
                    f"({self.max_bytes}); raise it on every daemon",
                    code=ErrorCode.TOO_LARGE,
                ),
            )
        elif job in self._too_large:
            self._too_large.discard(job)
            self.problems.pop(job, None)
        self._mesh.send_soon(self._joining.coordinator_name or COORDINATOR, advert)

    def _replica_plan(self, job: str, rank: int) -> str:
        """The replica plan engine rank `rank` holds ("" none): a coordinator that restarted
        keeps that replica's ranks serving it, and refuses only the ranks that claim it too."""
        plan = self.plans.get(job)
        return next((e.plan_hash for e in plan.expects if e.rank == rank), "") if plan else ""

    def _slot(self, job: str, rank: int) -> int:
        """The immediate counter of an engine rank here: stable while its session lives."""
        key = (job, rank)
        if key not in self._slots:
            used = set(self._slots.values())
            self._slots[key] = next(i for i in range(MAX_SLOTS) if i not in used)
        return self._slots[key]

    def release_slot(self, job: str, rank: int) -> None:
        self._slots.pop((job, rank), None)
        self.rank_problems.pop((job, rank), None)  # a rank that comes back is judged again

    def rank_plan(self, job: str, rank: int) -> RankPlan | None:
        plan = self.plans.get(job)
        return next((s for s in plan.sends if s.rank == rank), None) if plan else None

    def check(self, job: str, rank: int = -1) -> None:
        """Raise the job's plan problem, or engine rank `rank`'s, if the coordinator
        reported one."""
        if job in self.problems:
            raise self.problems[job]
        if (job, rank) in self.rank_problems:
            raise self.rank_problems[(job, rank)]

    async def changed(self, job: str, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the job's plan to be installed or withdrawn.

        A wait that ends otherwise (its time up, its session gone) takes its future out:
        they stayed until the job's plan next changed, which in a steady job is never, so
        a rank asking again and again (`GetPlan` with `after_plan` the plan it has, a
        short timeout, in a loop) grew the daemon by a future a request."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(job, {})
        waiting[fut] = None
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, timeout_s)
        finally:
            if self._waiters.get(job) is waiting:  # not popped by a change meanwhile
                waiting.pop(fut, None)
                if not waiting:
                    del self._waiters[job]

    def waits(self) -> int:
        """Waits for a plan change now, of every job (the status document's `plan_waits`)."""
        return sum(len(w) for w in self._waiters.values())

    def install(self, plan: NodePlan) -> None:
        plan = _scoped(plan)
        old = self.plans.get(plan.job)
        self.plans[plan.job] = plan
        self.problems.pop(plan.job, None)
        self.withdrawn.pop(plan.job, None)
        for e in plan.expects:  # a refused rank the plan now has (the replica's holder left)
            self.rank_problems.pop((plan.job, e.rank), None)
        self._users.use_plan(plan.job, plan)
        self._completions.install(plan.job, plan.plan_hash, plan.expects)
        self.grant_writers()
        related = nodes_of(plan)
        now = time.monotonic()
        everyone = set[str]().union(*map(nodes_of, self.plans.values()))
        self.related_since = {n: self.related_since.get(n, now) for n in everyone}
        for node in related - {self.node}:
            self._connect(node)
        if old is None or old.plan_hash != plan.plan_hash:
            log.info(
                "plan installed",
                job=plan.job,
                plan=plan.plan_hash,
                trainer_ranks=[s.rank for s in plan.sends],
                engine_ranks=[e.rank for e in plan.expects],
                heap_settle_s=round(heap.settle(), 4),
            )
        for fut in self._waiters.pop(plan.job, {}):
            if not fut.done():
                fut.set_result(None)

    def cleared(self, job: str, ranks: tuple[int, ...]) -> None:
        """The coordinator no longer refuses these engine ranks (the replica they claimed
        is no longer served by others, or the ranks that conflicted with them left): they
        wait for a plan again. Their refusal used to stay until a plan included them."""
        gone = [r for r in ranks if self.rank_problems.pop((job, r), None) is not None]
        if gone:
            log.info("engine ranks no longer refused", job=job, ranks=gone)

    def problem(self, job: str, err: PlanError, ranks: tuple[int, ...] = ()) -> None:
        """The coordinator cannot plan the job (two ranks claim one rank, ...): its plan is
        gone here, for the engine ranks and for the trainer ranks too, whose next version
        asks for a plan and hears this problem (they used to publish on the old plan, and
        the engine nodes refused the writes as `unauthorized`). `ranks`: only these engine
        ranks are refused (their waits end with it now); the plan and the others stay."""
        if ranks:
            for rank in ranks:
                self.rank_problems[(job, rank)] = err
                self._completions.end_rank(job, rank, err.message, err.code)
            log.warning("engine ranks refused", job=job, ranks=list(ranks), error=err.message)
            for fut in self._waiters.pop(job, {}):  # waits for a plan look again
                if not fut.done():
                    fut.set_result(None)
            return
        self.plans.pop(job, None)
        self.problems[job] = err
        self.withdrawn.pop(job, None)
        self._completions.drop_job(job, err.message, err.code)
        self.grant_writers()
        self._users.plan_problem(job, err)
        for fut in self._waiters.pop(job, {}):
            if not fut.done():
                fut.set_exception(err)

    def grant_writers(self) -> None:
        """Tell the transports who may write into each region of this node: an engine
        rank's regions the nodes its job's plan names as the rank's sources, with the
        plan's keys; every other region (staging, no plan) nobody. And which regions of
        other nodes the plans name (`named`)."""
        self.named()
        sessions = {s.id: s for s in self._sessions.values()}
        for region in self._registry.regions.values():
            writers: frozenset[str] = frozenset()
            scope = ""
            s = sessions.get(region.session)
            plan = self.plans.get(s.job) if s is not None and s.role == "engine" else None
            if s is not None and plan is not None:
                for e in plan.expects:
                    if e.rank == s.rank:
                        # elastic jobs: the replica's plan, which its writers scope by too
                        writers, scope = frozenset(e.sources), e.plan_hash or plan.plan_hash
            self._authorize(region.local.id, writers, scope)

    def named(self) -> None:
        """Tell the transports which regions of other nodes the installed plans name: a
        region that left them (its rank left, or released its memory: the coordinator
        withdrew the plan, or planned again without the region's CUDA key) is let go by a
        transport that mapped its memory by its keys (cuda: writes into it refused
        peer_lost, its IPC mapping closed once its copies are done)."""
        if self._peer_regions is None:
            return
        named = [r for plan in self.plans.values() for rp in plan.sends for r in rp.regions]
        self._peer_regions(named)

    def forget(self, job: str) -> None:
        """The last rank of `job` here left: its plan and any plan problem go with it (status
        showed them long after). A rank that comes back advertises and gets a plan again."""
        plan = self.plans.pop(job, None)
        problem = self.problems.pop(job, None)
        self.withdrawn.pop(job, None)
        self._too_large.discard(job)
        self.rank_problems = {k: v for k, v in self.rank_problems.items() if k[0] != job}
        self._completions.drop_job(job, "every rank of the job here left")
        if plan is not None:
            self.named()
        if plan is not None or problem is not None:
            log.info("job left this node", job=job, plan=plan.plan_hash if plan else None)

    def withdraw(self, job: str, reason: str, *, advertise: bool = True) -> None:
        """Stop using a job's plan (it involves a lost node) until the coordinator sends one.
        A version in flight fails with PEER_LOST: the peer is the cause, not the plan."""
        plan = self.plans.pop(job, None)
        if plan is None:
            return
        log.warning("plan withdrawn", job=job, plan=plan.plan_hash, reason=reason)
        self.grant_writers()
        self._users.use_plan(job, None, reason)
        if advertise:
            self.advertise(job)

    def incomplete(self, job: str, why: str) -> None:
        """The coordinator withdrew the job's plan: ranks of it left (`why` names them). The
        plan goes here as on a lost peer (this node's publishes used to go on with it, into
        the regions of the engine rank that had left); a trainer rank's next version waits
        for the next plan, whose timeout says `why` (`waiting`)."""
        if job in self.plans or any(s.job == job for s in self._sessions.values()):
            self.withdrawn[job] = why
            self.withdraw(job, why, advertise=False)  # the coordinator knows

    def waiting(self, job: str, timeout_s: float, otherwise: str) -> str:
        """Why a rank of `job` waited `timeout_s` for a plan in vain: its plan withdrawn,
        or `otherwise` (no plan yet)."""
        why = self.withdrawn.get(job)
        return f"{why}; none came within {timeout_s:g} s" if why else otherwise


def _scoped(plan: NodePlan) -> NodePlan:
    """The plan with its destinations' tcp keys rotated for it (`auth.plan_rkey`): by the
    plan's hash, or in an elastic job by the hash of the replica whose engine rank owns the
    region (what that rank expects, `Expect.plan_hash`). Several replicas may share a node
    (one SGLang server per GPU pair of an 8-GPU node), so the region's rank decides, not
    its node."""

    def owners(rp: RankPlan) -> dict[tuple[str, int], int]:
        """(node, region) -> the engine rank this rank's writes into it are counted at."""
        out: dict[tuple[str, int], int] = {}
        for b in rp.buckets:
            for w in b.writes:
                out.setdefault((w.dst_node, w.dst_region), w.dst_rank)
            for d in b.deltas:
                out.setdefault((d.dst_node, d.dst_region), d.dst_rank)
        for t in rp.trailers:
            out.setdefault((t.dst_node, t.dst_region), t.dst_rank)
        return out

    def scope(rp: RankPlan, owner: dict[tuple[str, int], int], r: RegionDescriptor) -> str:
        rank = owner.get((r.node, r.id))
        for part in rp.replicas:
            if (rank in part.ranks) if rank is not None else (r.node in part.nodes):
                return part.plan_hash
        return plan.plan_hash

    sends = []
    for rp in plan.sends:
        owner = owners(rp) if rp.replicas else {}
        regions = tuple(scoped(r, scope(rp, owner, r)) for r in rp.regions)
        sends.append(msgspec.structs.replace(rp, regions=regions))
    return msgspec.structs.replace(plan, sends=tuple(sends))


def elastic_engine_node(plan: NodePlan, node: str) -> bool:
    """`node` only hosts engine replicas of this (elastic) plan: losing it drops them."""
    replica_node = any(node in p.nodes for s in plan.sends for p in s.replicas)
    return replica_node and not any(node in e.sources for e in plan.expects)


def nodes_of(plan: NodePlan) -> set[str]:
    nodes = {r.node for s in plan.sends for r in s.regions}
    return nodes | {n for e in plan.expects for n in e.sources}
