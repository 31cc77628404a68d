"""The coordinator's jobs: what it knows of each (adverts, plan sent, problem), and what a
job's adverts make of it without I/O: its trainer and engine ranks, what is still missing,
what conflicts, the engines' delta areas, the digest of its planning inputs."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from weightwire.plan.planner import EngineRank, TrainerRank
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.peer import Advertise, AssignPlan
from weightwire.protocol.regions import RegionDescriptor

from .elastic import Elastic


@dataclass
class Job:
    name: str
    adverts: dict[str, Advertise] = field(default_factory=dict)
    inputs: str = ""  # digest of the adverts the current plan was made from
    plan_hash: str = ""
    assigned: dict[str, str] = field(default_factory=dict)  # node -> incarnation it was sent to
    problem: str = ""
    sent: dict[str, str] = field(default_factory=dict)  # elastic: node -> plan hash sent to it
    elastic: Elastic = field(default_factory=Elastic)
    worlds: dict[str, int] = field(default_factory=dict)  # role -> world size when last planned
    withdrawn: str = ""  # the plan withdrawn because ranks left ("" none): until the next
    told: dict[str, str] = field(default_factory=dict)  # node -> withdrawal it was told


def collect(
    job: Job, *, elastic: bool = False
) -> tuple[list[TrainerRank], list[EngineRank], list[str], list[str]]:
    """Trainer and engine ranks of a job, what is still missing, and what conflicts.
    `elastic`: engine ranks come in replicas (claims.py judges their conflicts, replica by
    replica), and only trainer ranks must all be there."""
    trainers: dict[int, TrainerRank] = {}
    engines: dict[int, EngineRank] = {}
    worlds: dict[str, set[int]] = defaultdict(set)
    dupes: list[str] = []
    for node, adv in sorted(job.adverts.items()):
        for r in adv.ranks:
            worlds[r.role].add(r.world_size)
            if r.role == "trainer":
                if r.rank in trainers:
                    dupes.append(f"trainer rank {r.rank} on {trainers[r.rank].node} and {node}")
                trainers[r.rank] = TrainerRank(node, r.rank, r.sources, r.lanes)
            else:
                if r.rank in engines and not elastic:
                    dupes.append(f"engine rank {r.rank} on {engines[r.rank].node} and {node}")
                engines[r.rank] = EngineRank(
                    node, r.rank, r.destinations, r.regions, r.slot, r.layout, r.lanes
                )
    problems = list(dupes)
    if elastic:
        worlds.pop("engine", None)
        engines = {}
    for role, sizes in worlds.items():
        if len(sizes) > 1:
            problems.append(f"{role} ranks disagree on world size: {sorted(sizes)}")
    missing = []
    for role, have in (("trainer", trainers), ("engine", engines)):
        if elastic and role == "engine":
            continue
        # every rank of a role gone, the job planned before: the ranks that it had
        size = next(iter(worlds.get(role, {job.worlds.get(role, 0)})))
        absent = [r for r in range(size) if r not in have]
        if not size:
            missing.append(f"any {role} rank")
        elif absent:
            missing.append(f"{role} ranks {_some(absent)}")
    return list(trainers.values()), list(engines.values()), missing, problems


def world_sizes(job: Job) -> dict[str, int]:
    """Each role's world size, as the job's ranks advertise it."""
    return {r.role: r.world_size for adv in job.adverts.values() for r in adv.ranks}


def misnamed(sender: str, adv: Advertise) -> str:
    """Why `sender`'s advert names another node where only its own may stand ("" if it does
    not): a node advertises its own ranks and regions only. (A region naming another node
    was planned as this node's all the same: writes went to the advertising node.)"""
    if adv.node != sender:
        return f"an advert from {sender} says its node is {adv.node!r}"
    for i, r in enumerate(adv.ranks):
        for j, g in enumerate(r.regions):
            if g.node != sender:
                return (
                    f"the advert of job {adv.job!r} from {sender}: ranks[{i}].regions[{j}].node "
                    f"is {g.node!r}; a node advertises only its own regions"
                )
    return ""


def _some(ranks: list[int], shown: int = 16) -> str:
    """A list of ranks as text, the first `shown` of a long one and how many there are."""
    if len(ranks) <= shown:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:shown]))}, ...] ({len(ranks)} ranks)"


def delta_areas(job: Job) -> dict[tuple[str, int], RegionDescriptor]:
    """(node, engine rank) -> the delta area that engine rank registered."""
    areas = {}
    for node, adv in job.adverts.items():
        for r in adv.ranks:
            if r.role == "engine" and r.delta_region >= 0:
                area = next((g for g in r.regions if g.id == r.delta_region), None)
                if area is not None:
                    areas[(node, r.rank)] = area
    return areas


def digest(job: Job) -> str:
    """The job's planning inputs (every node's ranks), as one hash."""
    h = hashlib.sha256()
    enc = msgspec.msgpack.Encoder(order="deterministic")
    for node, adv in sorted(job.adverts.items()):
        h.update(enc.encode([node, adv.ranks]))
    return h.hexdigest()


_plain = msgspec.msgpack.Encoder()


def too_large(node: str, msg: AssignPlan, limit: int) -> PlanError | None:
    """Why `msg` cannot go to `node` in one message (None: it fits, or `limit` is 0). The
    node would drop it as too large, and its ranks wait for a plan, told of nothing."""
    if not limit:
        return None
    size = len(_plain.encode(msg)) + 64  # and its tag frame
    if size <= limit:
        return None
    return PlanError(
        f"the plan of job {msg.plan.job!r} for {node} is {size} bytes, more than "
        f"max_message_bytes ({limit}) allows in one message; raise it on every daemon",
        code=ErrorCode.TOO_LARGE,
    )
