"""The coordinator role: membership, advertisements, and the plan of every job.

No weight byte passes through it. It recomputes a job's plan only when the job's
membership or layouts change; an unchanged input gives the same plan and hash.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import structlog

from weightwire.plan.delta import add_delta
from weightwire.plan.planner import (
    PlanOptions,
    caveats_of,
    resolve_recipes,
)
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PlanError, WeightwireError
from weightwire.protocol.peer import (
    Advertise,
    AssignPlan,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerWelcome,
    PlanProblem,
)
from weightwire.protocol.plan import NodePlan

from .elastic import is_elastic
from .elasticplanning import ElasticPlanning, Send, lacking
from .jobs import Job, collect, delta_areas, digest, misnamed, too_large, world_sizes
from .lograte import Throttled
from .planrun import Stop, planned
from .ratelimit import HELLO_BURST, HELLO_RATE, Buckets

log = structlog.get_logger("weightwire.daemon.coordinator")

MAX_JOBS_PER_NODE = 256  # jobs one node may hold ranks in at once (a host runs a few)


@dataclass
class Coordinator:
    node: str
    send: Send
    options: PlanOptions
    heartbeat_timeout_s: float
    max_bytes: int = 0  # the largest message a daemon takes: a plan larger is a problem
    members: dict[str, Member] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    _planning: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _stops: dict[str, Stop] = field(default_factory=dict)  # each job's planning run's (planrun)
    _plans: dict[str, Mapping[str, NodePlan]] = field(default_factory=dict)  # made when sent
    _refused: Throttled = field(default_factory=lambda: Throttled(10.0))
    _hellos: Buckets = field(default_factory=lambda: Buckets(HELLO_RATE, HELLO_BURST))
    _hellos_dropped: Throttled = field(default_factory=lambda: Throttled(10.0))
    _elastic: ElasticPlanning = field(init=False)

    def __post_init__(self) -> None:
        self._elastic = ElasticPlanning(
            self.send, self.members, self.options, self._problem, self._withdraw, self.max_bytes
        )

    # --- membership ----------------------------------------------------------

    def binding_refusal(self, m: Member, key: bytes | None) -> str | None:
        """Why a hello for `m` authenticated with `key` must be refused (None: admit it). The
        first hello claiming a name binds it to its key for as long as the name is a member;
        another key claiming it meanwhile is refused, and so is a key that already speaks as
        another member. Without CURVE (key None) names are claims, unchecked."""
        if key is None:
            return None
        text = key.decode()
        if m.public_key != text:
            return f"{m.node} says its key is {m.public_key!r} but authenticated with another"
        bound = self.members.get(m.node)
        if bound is not None and bound.public_key != text:
            return f"{m.node} is a member with another key"
        holder = next((n for n, b in self.members.items() if b.public_key == text), m.node)
        if holder != m.node:
            return f"this key is already member {holder}'s"
        return None

    def on_hello(self, sender: str, hello: PeerHello) -> None:
        if not self._hellos.take(sender):
            # each is answered (a welcome and the membership), and one with a new
            # incarnation is broadcast to every member: a member that sent them in a loop
            # made every daemon of the cluster work for each
            self._hellos_dropped.emit(
                log.warning, "hellos dropped", peer=sender, rate_per_s=HELLO_RATE
            )
            return
        m = hello.member
        if hello.protocol != PROTOCOL_VERSION or m.node != sender:
            if hello.protocol != PROTOCOL_VERSION:
                code = "protocol"
                why = (
                    f"{sender} speaks protocol {hello.protocol}, the coordinator "
                    f"{PROTOCOL_VERSION}: run the same weightwire version on every node"
                )
            else:
                code, why = "invalid", f"{sender} says it is node {m.node!r}"
            self._refused.emit(log.warning, "peer refused", peer=sender, reason=why)
            self.send(sender, PeerError(code=code, message=why, req=hello.req))
            return
        old = self.members.get(m.node)
        self.members[m.node] = m
        self.last_seen[m.node] = time.monotonic()
        self.send(
            m.node, PeerWelcome(protocol=PROTOCOL_VERSION, coordinator=self.node, req=hello.req)
        )
        if old is None or old.incarnation != m.incarnation:
            log.info("member joined", peer=m.node, endpoint=m.endpoint, incarnation=m.incarnation)
            if old is not None:
                self._drop_node(m.node, keep_member=True)
            self.broadcast()
        else:
            self.send(m.node, Membership(members=tuple(self.members.values())))

    def seen(self, node: str) -> None:
        if node in self.members:
            self.last_seen[node] = time.monotonic()

    def broadcast(self, lost: tuple[str, ...] = ()) -> None:
        msg = Membership(members=tuple(self.members.values()), lost=lost)
        for node in self.members:
            self.send(node, msg)

    def check_liveness(self) -> None:
        now = time.monotonic()
        lost = tuple(
            sorted(
                n
                for n in self.members
                if n != self.node and now - self.last_seen.get(n, 0) > self.heartbeat_timeout_s
            )
        )
        if not lost:
            return
        for node in lost:
            log.warning(
                "member lost", peer=node, silent_s=round(now - self.last_seen.get(node, 0), 2)
            )
            self._drop_node(node, keep_member=False)
        self.broadcast(lost)

    def _drop_node(self, node: str, *, keep_member: bool) -> None:
        if not keep_member:
            self.members.pop(node, None)
            self.last_seen.pop(node, None)
        for job in list(self.jobs.values()):
            job.told.pop(node, None)  # a node that comes back is told afresh
            if job.adverts.pop(node, None) is None:
                continue
            if any(a.ranks for a in job.adverts.values()):
                self._replan(job)
            else:  # its last node is gone: the job used to stay, listed, for ever
                self._end_job(job)

    # --- adverts and plans ---------------------------------------------------

    def on_advertise(self, sender: str, adv: Advertise) -> None:
        member = self.members.get(sender)
        if member is None or member.incarnation != adv.incarnation:
            self._refused.emit(log.warning, "advert from a non-member ignored", peer=sender)
            return
        if why := misnamed(sender, adv):  # refused whole: its previous advert stands
            self._refused.emit(log.warning, "advert refused", peer=sender, job=adv.job, reason=why)
            self.send(sender, PlanProblem(job=adv.job, code=ErrorCode.INVALID.value, message=why))
            return
        known = self.jobs.get(adv.job)
        if (known is None or sender not in known.adverts) and adv.ranks and self._too_many(sender):
            why = (
                f"{sender} holds ranks in {MAX_JOBS_PER_NODE} jobs already (the most a node "
                f"may); job {adv.job!r} is not planned"
            )
            self._refused.emit(log.warning, "advert refused", peer=sender, job=adv.job, reason=why)
            self.send(sender, PlanProblem(job=adv.job, code=ErrorCode.TOO_LARGE.value, message=why))
            return
        job = self.jobs.setdefault(adv.job, Job(adv.job))
        prev = job.adverts.get(sender)
        if prev is not None and prev.incarnation == adv.incarnation and prev.seq > adv.seq:
            return
        job.adverts[sender] = adv
        if not any(a.ranks for a in job.adverts.values()):
            self._end_job(job)  # every rank of it has left: nothing to plan, nothing to show
            return
        if adv.plan_hash != job.sent.get(sender, job.plan_hash):
            job.assigned.pop(sender, None)  # it lost or never had the current plan
        self._replan(job)

    def _too_many(self, node: str) -> bool:
        held = sum(1 for j in self.jobs.values() if (a := j.adverts.get(node)) and a.ranks)
        return held >= MAX_JOBS_PER_NODE

    def _end_job(self, job: Job) -> None:
        self._supersede(job.name)
        self.jobs.pop(job.name, None)
        self._plans.pop(job.name, None)
        log.info("job ended: every rank left", job=job.name, plan=job.plan_hash or None)

    def _supersede(self, name: str) -> None:
        """Cancel the job's planning task, and stop its thread in the planner (planrun)."""
        running = self._planning.pop(name, None)
        if running is not None:
            running.cancel()
        stop = self._stops.pop(name, None)
        if stop is not None:
            stop.set()

    def _replan(self, job: Job) -> None:
        self._supersede(job.name)
        stop = self._stops[job.name] = Stop(job.name)
        loop = asyncio.get_running_loop()
        self._planning[job.name] = loop.create_task(self._plan_job(job, stop))

    async def _plan_job(self, job: Job, stop: Stop) -> None:
        try:
            await self._plan_job_now(job, stop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a planner bug must be seen, and must not kill the daemon
            log.exception("planning failed", job=job.name)
            self._problem(job, WeightwireError(f"internal planning error: {exc!r}"))

    async def _plan_job_now(self, job: Job, stop: Stop) -> None:
        if is_elastic(job.adverts):
            await self._elastic.plan(job, stop)
            return
        trainers, engines, missing, problems = collect(job)
        if problems:
            self._problem(job, PlanError("; ".join(problems), code=ErrorCode.DUPLICATE))
            return
        if missing:
            self._withdraw(job, missing)
            return
        inputs = digest(job)
        if inputs == job.inputs and job.plan_hash:
            self._assign(job, None)  # only nodes whose incarnation changed get it again
            return
        t0 = time.monotonic()
        try:
            engines = resolve_recipes(engines)
            slots = {e.rank: e.slot for e in engines}
            areas = delta_areas(job)
            options = (
                msgspec.structs.replace(self.options, share_keys=True) if areas else self.options
            )
            made = await planned(stop, job.name, trainers, engines, options, slots)
            plans = add_delta(made, areas)
        except WeightwireError as exc:
            self._problem(job, exc)
            return
        job.inputs, job.problem, job.withdrawn, job.told = inputs, "", "", {}
        job.worlds = world_sizes(job)
        new_hash = plans.plan_hash
        if new_hash != job.plan_hash:
            job.assigned = {}
            for caveat in caveats_of(engines):
                log.warning("plan caveat", job=job.name, plan=new_hash, caveat=caveat)
        job.plan_hash = new_hash
        writes = plans.write_count  # counted on the plan's arrays: no node plan is made
        log.info(
            "plan ready",
            job=job.name,
            plan=job.plan_hash,
            trainers=len(trainers),
            engines=len(engines),
            nodes=len(plans),
            writes=writes,
            seconds=round(time.monotonic() - t0, 4),
        )
        self._assign(job, plans)

    def _assign(self, job: Job, plans: Mapping[str, NodePlan] | None) -> None:
        if plans is not None:
            self._plans[job.name] = plans
        plans = self._plans.get(job.name, {})
        for node in plans:
            member = self.members.get(node)
            if member is None or job.assigned.get(node) == member.incarnation:
                continue
            msg = AssignPlan(plan=plans[node])  # made now, from the plan's arrays
            if (err := too_large(node, msg, self.max_bytes)) is not None:
                self._problem(job, err)  # every node of the job hears it, none plans on
                return
            self.send(node, msg)
            job.assigned[node] = member.incarnation

    def _withdraw(self, job: Job, missing: list[str]) -> None:
        """The job lacks ranks (`missing`): it has no plan. Where it had one (a rank left),
        each node of the job is told, naming what is missing: the nodes kept the plan, and
        a trainer rank published on into the regions of an engine rank that had left
        (`unknown_region`, not retryable, until the rank came back). A node told drops
        the plan as on a lost peer (a version in flight fails `peer_lost`); a trainer
        rank's next publish waits for the next plan, as for its first, and at its timeout
        fails `not_ready` saying this. A job never planned waits for its ranks, untold."""
        if job.plan_hash:
            log.info(
                "job incomplete; plan withdrawn", job=job.name, plan=job.plan_hash, missing=missing
            )
            job.withdrawn = job.plan_hash
        job.plan_hash, job.inputs, job.assigned, job.sent = "", "", {}, {}
        if not job.withdrawn:
            return
        why = (
            f"plan {job.withdrawn} of job {job.name!r} withdrawn: the job lacks "
            f"{'; '.join(missing)} (a rank left); publishes wait for a new plan"
        )
        for node, adv in job.adverts.items():
            if adv.ranks and job.told.get(node) != why:
                job.told[node] = why
                msg = PlanProblem(
                    job=job.name, code=ErrorCode.NOT_READY.value, message=why, withdrawn=True
                )
                self.send(node, msg)

    def _problem(self, job: Job, exc: WeightwireError) -> None:
        job.plan_hash, job.inputs, job.assigned, job.sent = "", "", {}, {}
        job.withdrawn, job.told = "", {}  # the problem stands in its place at the nodes
        if job.problem == exc.message:
            return
        job.problem = exc.message
        log.warning("plan impossible", job=job.name, code=exc.code.value, error=exc.message)
        for node in job.adverts:
            self.send(node, PlanProblem(job=job.name, code=exc.code.value, message=exc.message))

    def _running(self, name: str) -> str | None:
        """What the job's planning run is doing (None: no run under way)."""
        task, stop = self._planning.get(name), self._stops.get(name)
        if task is None or task.done() or stop is None:
            return None
        return stop.phase or "preparing"

    def missing(self, job: str) -> list[str] | None:
        """What a job still lacks before it can be planned (None: no such job)."""
        j = self.jobs.get(job)
        return _missing(j) if j is not None else None

    def status(self) -> dict[str, object]:
        return {
            "members": sorted(self.members),
            "jobs": {
                j.name: {
                    "plan": j.plan_hash or None,
                    "problem": j.problem or None,
                    "nodes": sorted(j.adverts),
                    "missing": _missing(j),
                    "withdrawn": j.withdrawn or None,  # the plan withdrawn: ranks left
                    "replicas": sorted(j.elastic.parts) if is_elastic(j.adverts) else None,
                    "planning": self._running(j.name),
                }
                for j in self.jobs.values()
            },
        }


def _missing(job: Job) -> list[str]:
    """What the job lacks before it can be planned."""
    return lacking(job) if is_elastic(job.adverts) else collect(job)[2]
