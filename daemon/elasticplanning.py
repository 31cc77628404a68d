"""The coordinator's planning of elastic jobs (what they are: `elastic.py`): each complete
engine replica planned on its own, only when its inputs changed, and every node whose part
changed sent its new plan."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from weightwire.plan.planner import (
    EngineRank,
    PlanOptions,
    TrainerRank,
    resolve_recipes,
)
from weightwire.protocol.errors import ErrorCode, PlanError, WeightwireError
from weightwire.protocol.peer import AssignPlan, Member, PeerMsg, PlanProblem

from .claims import Refusal, claims
from .elastic import (
    Replica,
    ReplicaPlan,
    node_hashes,
    node_plan,
    packs_digest,
    trainers_digest,
)
from .jobs import Job, collect, too_large
from .planrun import Stop, planned

log = structlog.get_logger("weightwire.daemon.coordinator")

Send = Callable[[str, PeerMsg], None]


@dataclass
class ElasticPlanning:
    """Plans elastic jobs for the coordinator: `members` its live view of the cluster,
    `problem` how a job that cannot be planned at all is withdrawn and reported, `withdraw`
    how one that lacks ranks is (what it lacks)."""

    send: Send
    members: Mapping[str, Member]
    options: PlanOptions
    problem: Callable[[Job, WeightwireError], None]
    withdraw: Callable[[Job, list[str]], None]
    max_bytes: int = 0  # the largest message a daemon takes (jobs.too_large)

    async def plan(self, job: Job, stop: Stop) -> None:
        """Plan each complete engine replica on its own (only those not planned yet with
        these inputs), and send every node whose part changed its new plan."""
        trainers, _, missing, problems = collect(job, elastic=True)
        if problems:
            self.problem(job, PlanError("; ".join(problems), code=ErrorCode.DUPLICATE))
            return
        el = job.elastic
        replicas, refused = claims(job.adverts, el.held, el.made)
        self._tell(job, refused)
        live = {r: rep for r, rep in replicas.items() if rep.complete}
        if not live:
            missing.append(_incomplete(replicas.values()))
        if missing:
            self.withdraw(job, missing)
            return
        td = trainers_digest(job.adverts)
        if el.trainers != td:
            el.trainers, el.parts, el.packs = td, {}, ""
        for r in [r for r in el.parts if r not in live]:
            log.info("engine replica dropped", job=job.name, replica=r)
            del el.parts[r]
        if not el.parts:
            el.packs = ""
        t0 = time.monotonic()
        planned: list[int] = []
        for r, rep in live.items():
            inputs = rep.digest(td)
            part = el.parts.get(r)
            if part is not None and part.inputs == inputs:
                continue
            el.parts.pop(r, None)
            part = await self._replica(job, trainers, rep, inputs, stop)
            if part is not None:
                el.parts[r] = part
                el.remember(part.plan_hash)
                el.packs = el.packs or part.packs
                planned.append(r)
        el.held = {r: p.replica for r, p in el.parts.items()}
        if not el.parts:
            job.plan_hash, job.assigned, job.sent = "", {}, {}
            return
        hashes, whole = node_hashes(el.packs, el.parts.values())
        job.problem, job.withdrawn, job.told = "", "", {}
        if whole != job.plan_hash:
            log.info(
                "plan ready",
                job=job.name,
                plan=whole,
                replicas=sorted(el.parts),
                planned=planned,
                trainers=len(trainers),
                nodes=len(hashes),
                seconds=round(time.monotonic() - t0, 4),
            )
        job.plan_hash = whole
        for node in [n for n in job.sent if n not in hashes]:
            hashes[node] = ""  # a node left with no part: it is told so (an empty plan)
        for node, node_hash in hashes.items():
            member = self.members.get(node)
            if member is None:
                job.sent.pop(node, None)
                continue
            if job.assigned.get(node) == member.incarnation and job.sent.get(node) == node_hash:
                continue
            msg = AssignPlan(plan=node_plan(job.name, el.packs, el.parts.values(), node))
            if (err := too_large(node, msg, self.max_bytes)) is not None:
                self.problem(job, err)  # every node of the job hears it
                return
            self.send(node, msg)
            job.assigned[node] = member.incarnation
            if node_hash:
                job.sent[node] = node_hash
            else:
                job.sent.pop(node, None)

    def _tell(self, job: Job, refused: list[Refusal]) -> None:
        """Each refused engine rank is told why, once per advert of its node (a rank that
        left and came back is told again)."""
        el = job.elastic
        told: dict[tuple[str, int], str] = {}
        for refusal in refused:
            for node, ranks in refusal.ranks.items():
                adv = job.adverts.get(node)
                seq = adv.seq if adv is not None else 0
                fresh = tuple(
                    r for r in ranks if el.told.get((node, r)) != f"{seq}:{refusal.message}"
                )
                told.update({(node, r): f"{seq}:{refusal.message}" for r in ranks})
                if not fresh:
                    continue
                log.warning(
                    "engine ranks refused", job=job.name, node=node, ranks=fresh,
                    error=refusal.message,
                )  # fmt: skip
                self.send(
                    node,
                    PlanProblem(
                        job=job.name,
                        code=ErrorCode.DUPLICATE.value,
                        message=refusal.message,
                        ranks=fresh,
                    ),
                )
        self._clear(job, [k for k in el.told if k not in told])
        el.told = told

    def _clear(self, job: Job, keys: list[tuple[str, int]]) -> None:
        """Ranks refused before and no longer (the replica they claimed lost its holders,
        the ranks they conflicted with left) are told so, where they still advertise: their
        refusal used to stay until a plan included them, which one that cannot be planned
        yet (its replica incomplete) never did."""
        by_node: dict[str, list[int]] = {}
        for node, rank in keys:
            adv = job.adverts.get(node)
            if adv is not None and any(r.role == "engine" and r.rank == rank for r in adv.ranks):
                by_node.setdefault(node, []).append(rank)
        for node, ranks in sorted(by_node.items()):
            log.info("engine ranks no longer refused", job=job.name, node=node, ranks=ranks)
            self.send(
                node,
                PlanProblem(
                    job=job.name, code="", message="", ranks=tuple(sorted(ranks)), cleared=True
                ),
            )

    async def _replica(
        self, job: Job, trainers: list[TrainerRank], rep: Replica, inputs: str, stop: Stop
    ) -> ReplicaPlan | None:
        """One replica's plan, or None (its nodes are told why; the others go on)."""
        el = job.elastic
        t0 = time.monotonic()
        try:
            engines = resolve_recipes(
                [
                    EngineRank(node, a.rank, a.destinations, a.regions, a.slot, a.layout, a.lanes)
                    for node, a in rep.ranks
                ]
            )
            slots = {e.rank: e.slot for e in engines}
            plans = await planned(stop, job.name, trainers, engines, self.options, slots)
            packs = packs_digest(plans.compact)
            if el.packs and packs != el.packs:
                raise PlanError(
                    f"engine replica {rep.replica} packs differently from the job's other "
                    f"replicas (another layout, tensor list or registration order); the "
                    f"replicas of an elastic job must be alike"
                )
        except WeightwireError as exc:
            log.warning(
                "engine replica refused", job=job.name, replica=rep.replica, error=exc.message
            )
            for node in rep.nodes:  # that replica's ranks; the nodes' other ranks go on
                ranks = tuple(a.rank for n, a in rep.ranks if n == node)
                problem = PlanProblem(
                    job=job.name, code=exc.code.value, message=exc.message, ranks=ranks
                )
                self.send(node, problem)
            return None
        log.info(
            "engine replica planned",
            job=job.name,
            replica=rep.replica,
            plan=plans.plan_hash,
            ranks=[a.rank for _, a in rep.ranks],
            writes=plans.write_count,
            seconds=round(time.monotonic() - t0, 4),
        )
        return ReplicaPlan(rep, inputs, plans, packs)


def lacking(job: Job) -> list[str]:
    """What an elastic job lacks before it can be planned: trainer ranks, or a complete
    engine replica (each incomplete one's absent ranks)."""
    missing = collect(job, elastic=True)[2]
    replicas, _ = claims(job.adverts, job.elastic.held, job.elastic.made)
    if not any(rep.complete for rep in replicas.values()):
        missing.append(_incomplete(replicas.values()))
    return missing


def _incomplete(replicas: Iterable[Replica]) -> str:
    """What a job none of whose engine replicas is complete lacks: each replica's absent
    ranks."""
    parts = [
        f"engine ranks {[r for r in range(rep.size) if r not in {a.rank for _, a in rep.ranks}]}"
        f" of replica {rep.replica}"
        for rep in sorted(replicas, key=lambda rep: rep.replica)
    ]
    return "; ".join(parts) or "any complete engine replica"
