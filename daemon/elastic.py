"""Elastic jobs: engine replicas planned one by one, and the plan put together from them.

An engine replica is one engine, all its ranks (`Hello.replica` / `replica_size`). Each
complete replica is planned on its own, against all trainer ranks, and kept by the digest
of its inputs: a replica that leaves costs no planning at all, and one that joins costs
the planning of that replica only. Replicas of one model share their packs (the planner is
deterministic, and what a trainer rank packs depends only on the engine tensor list that
replicas share), so a trainer rank packs each piece once and writes it to every live
replica. A replica whose packs differ from the others' (another layout) is refused on its
own, naming it.

Trainer ranks' plans carry the packs' hash as `plan_hash`, the same whichever replicas are
live, and one `ReplicaPart` per replica with that replica's own hash; engine ranks' Expects
carry their replica's hash. A replica coming or going therefore changes neither the other
replicas' engine plans nor the trainer writes prepared for them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from weightwire.protocol.peer import Advertise, RankAdvert
from weightwire.protocol.plan import Bucket, Expect, NodePlan, RankPlan, ReplicaPart

if TYPE_CHECKING:  # numpy loads with the planner, only in a daemon that coordinates
    from weightwire.plan.compact import Compact, PlanSet

_enc = msgspec.msgpack.Encoder(order="deterministic")
MADE_KEPT = 1024  # replica plans a job remembers making (a few bytes each)


def is_elastic(adverts: Mapping[str, Advertise]) -> bool:
    return any(r.role == "engine" and r.replica >= 0 for a in adverts.values() for r in a.ranks)


@dataclass(frozen=True)
class Replica:
    """The engine ranks of one replica, as advertised."""

    replica: int
    size: int
    ranks: tuple[tuple[str, RankAdvert], ...]  # (node, rank), by rank

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.size and len({r.rank for _, r in self.ranks}) == self.size

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({n for n, _ in self.ranks}))

    def digest(self, trainers: str) -> str:
        h = hashlib.sha256(trainers.encode())
        for node, r in self.ranks:  # not the plan the rank holds: that is this plan
            h.update(_enc.encode([node, msgspec.structs.replace(r, replica_plan="")]))
        return h.hexdigest()


def trainers_digest(adverts: Mapping[str, Advertise]) -> str:
    h = hashlib.sha256()
    for node, adv in sorted(adverts.items()):
        ranks = [r for r in adv.ranks if r.role == "trainer"]
        if ranks:  # engine nodes coming and going change nothing here
            h.update(_enc.encode([node, ranks]))
    return h.hexdigest()


def packs_digest(compact: Compact) -> str:
    """What the trainer ranks pack, and where: equal for replicas that share a layout."""
    import numpy as np

    h = hashlib.sha256()
    h.update(_enc.encode([compact.job, compact.options]))
    for t in compact.trainers:
        h.update(_enc.encode([t.node, t.rank, t.lanes]))
    k = compact.keys
    h.update(_enc.encode([k.source, k.box, k.transform, k.nbytes]))
    p = compact.packs
    for arr in (
        p.trainer, p.key, p.nbytes, p.bucket, p.offset, p.region,
        p.b_trainer, p.b_index, p.b_expert, p.b_nbytes, p.b_first_pack, p.staging,
    ):  # fmt: skip
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@dataclass
class ReplicaPlan:
    replica: Replica
    inputs: str  # digest of the trainers' and this replica's adverts
    plans: PlanSet
    packs: str  # packs_digest
    _rank_plans: dict[int, RankPlan] = field(default_factory=dict)  # trainer index -> plan

    @property
    def plan_hash(self) -> str:
        return self.plans.plan_hash

    def rank_plan(self, t: int) -> RankPlan:
        """Trainer index t's plan for this replica alone (made once)."""
        rp = self._rank_plans.get(t)
        if rp is None:
            rp = self._rank_plans[t] = self.plans.compact.rank_plan(t)
        return rp

    def expects(self, node: str) -> tuple[Expect, ...]:
        c = self.plans.compact
        if node not in {e.node for e in c.engines}:
            return ()
        return tuple(
            msgspec.structs.replace(e, plan_hash=self.plan_hash) for e in c.node_plan_expects(node)
        )


@dataclass
class Elastic:
    """A job's replica plans, kept while the trainer ranks stay the same."""

    trainers: str = ""  # trainers_digest the parts were made with
    packs: str = ""  # the packs every part shares
    parts: dict[int, ReplicaPlan] = field(default_factory=dict)  # replica -> its plan
    held: dict[int, Replica] = field(default_factory=dict)  # replicas planned last (claims.py)
    told: dict[tuple[str, int], str] = field(default_factory=dict)  # refused (node, rank): why
    made: dict[str, None] = field(default_factory=dict)  # replica plans made here (claims.py)

    def remember(self, plan_hash: str) -> None:
        """A replica plan this coordinator made (the last MADE_KEPT of them)."""
        self.made.pop(plan_hash, None)
        self.made[plan_hash] = None
        while len(self.made) > MADE_KEPT:
            del self.made[next(iter(self.made))]


def node_hashes(packs: str, parts: Iterable[ReplicaPlan]) -> tuple[dict[str, str], str]:
    """Each node's plan hash, and the whole plan's: a trainer node's covers every live
    replica, an engine node's only its own replicas (so it stays when others change)."""
    parts = sorted(parts, key=lambda p: p.replica.replica)
    whole = _hash(packs, [p.plan_hash for p in parts])
    out = {t.node: whole for t in parts[0].plans.compact.trainers} if parts else {}
    for p in parts:
        for node in p.replica.nodes:
            if node not in out:
                out[node] = _hash(packs, [q.plan_hash for q in parts if node in q.replica.nodes])
    return out, whole


def node_plan(job: str, packs: str, parts: Iterable[ReplicaPlan], node: str) -> NodePlan:
    """`node`'s plan over the live replicas `parts` (each planned on its own)."""
    parts = sorted(parts, key=lambda p: p.replica.replica)
    hashes, _ = node_hashes(packs, parts)
    if not parts or node not in hashes:
        return NodePlan(plan_hash=_hash(packs, []), job=job)
    compact = parts[0].plans.compact
    replica_parts = tuple(
        ReplicaPart(
            replica=p.replica.replica,
            plan_hash=p.plan_hash,
            ranks=tuple(r.rank for _, r in p.replica.ranks),
            nodes=p.replica.nodes,
        )
        for p in parts
    )
    sends: list[RankPlan] = []
    for t, trainer in enumerate(compact.trainers):
        if trainer.node != node:
            continue
        each = [p.rank_plan(t) for p in parts]
        first = each[0]
        buckets = tuple(
            Bucket(
                index=b.index,
                kind=b.kind,
                packs=b.packs,
                writes=tuple(w for rp in each for w in rp.buckets[i].writes),
                nbytes=b.nbytes,
            )
            for i, b in enumerate(first.buckets)
        )
        sends.append(
            RankPlan(
                plan_hash=packs,
                rank=trainer.rank,
                staging_bytes=first.staging_bytes,
                buckets=buckets,
                regions=tuple({(r.node, r.id): r for rp in each for r in rp.regions}.values()),
                replicas=replica_parts,
            )
        )
    expects = tuple(e for p in parts for e in p.expects(node))
    return NodePlan(plan_hash=hashes[node], job=job, sends=tuple(sends), expects=expects)


def _hash(packs: str, hashes: list[str]) -> str:
    return hashlib.sha256(_enc.encode([packs, hashes])).hexdigest()[:16]
