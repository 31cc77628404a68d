"""Which engine ranks of an elastic job make up each replica, and which are refused.

An engine rank joins a replica by naming it (`Hello.replica`). A rank can name a replica
that others already serve: another rank number than the replica has room for, another
size, the same rank again. The replica that is planned (`held`) keeps its ranks and
serves on; the claimants are refused, each told (a `duplicate` error naming the replica and
the hosts), and nothing else of the job changes (a coordinator that restarted knows the
planned replicas from the adverts: `recalled`). A replica not planned yet whose ranks
conflict is refused as a whole, its ranks told why; the job's other replicas go on. The
coordinator used to count a claimant into the replica, which then was no longer complete
and was dropped from the plan without a word (or, sizes disagreeing, withdrew the job).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from weightwire.protocol.peer import Advertise, RankAdvert

from .elastic import Replica


@dataclass(frozen=True)
class Refusal:
    """Engine ranks refused: `ranks` by node, all told `message`."""

    message: str
    ranks: Mapping[str, tuple[int, ...]]


Member = tuple[str, RankAdvert]


def _where(members: list[Member] | tuple[Member, ...]) -> str:
    return ", ".join(f"engine rank {r.rank} on {n}" for n, r in members)


def _refuse(message: str, members: list[Member]) -> Refusal:
    ranks: dict[str, list[int]] = {}
    for n, r in members:
        ranks.setdefault(n, []).append(r.rank)
    return Refusal(message, {n: tuple(sorted(rs)) for n, rs in ranks.items()})


def claims(
    adverts: Mapping[str, Advertise],
    held: Mapping[int, Replica],
    made: Collection[str] = (),
) -> tuple[dict[int, Replica], list[Refusal]]:
    """The replicas of an elastic job's adverts (complete or not), and the ranks refused.
    `held`: the replicas planned last, whose ranks keep them while they all advertise;
    `made`: the replica plans this coordinator made (`recalled`)."""
    members: dict[int, list[Member]] = {}
    refused: list[Refusal] = []
    for node, adv in sorted(adverts.items()):
        for r in adv.ranks:
            if r.role != "engine":
                continue
            if r.replica < 0:
                refused.append(
                    _refuse(
                        f"engine rank {r.rank} on {node} names no replica, in a job whose other "
                        f"engine ranks do (give every Engine replica= and replica_size=)",
                        [(node, r)],
                    )
                )
                continue
            members.setdefault(r.replica, []).append((node, r))
    held = {**held, **recalled(members, held, made)}
    out: dict[int, Replica] = {}
    taken: dict[int, str] = {}  # engine rank -> which replica, where
    kept = {rid for rid, ms in members.items() if _holders(held.get(rid), ms) is not None}
    for rid in sorted(members, key=lambda rid: (rid not in kept, rid)):
        ms = members[rid]
        holders = _holders(held.get(rid), ms) if rid in kept else None
        if holders is not None:
            claimants = [m for m in ms if m not in holders]
            for n, r in claimants:
                refused.append(
                    _refuse(
                        f"engine replica {rid} is served by {_where(holders)}; engine rank "
                        f"{r.rank} on {n} claims it too (replica_size {r.replica_size}): give "
                        f"each engine replica an id of its own",
                        [(n, r)],
                    )
                )
            ms = holders
        else:
            problem = _conflict(rid, ms, taken)
            if problem:
                refused.append(_refuse(problem, ms))
                continue
        out[rid] = Replica(rid, ms[0][1].replica_size, tuple(sorted(ms, key=lambda m: m[1].rank)))
        taken.update({r.rank: f"replica {rid} on {n}" for n, r in ms})
    return out, refused


def recalled(
    members: Mapping[int, list[Member]],
    held: Mapping[int, Replica] | None = None,
    made: Collection[str] = (),
) -> dict[int, Replica]:
    """The replicas the adverts say were planned (`RankAdvert.replica_plan`): each one's
    ranks that hold one replica plan, where they make the whole replica. A coordinator that
    restarted knows no replica it planned: a claimant there at the time used to get the
    whole replica refused, its serving ranks with it, until the claimant left.

    They win over `held`: a coordinator that restarted and heard the claimant's host first
    planned the claimant as the replica, knowing no other rank of it, and kept that pick
    when the serving ranks came back holding the replica's plan (the serving rank was
    refused, the claimant kept the replica). Of several groups that serve plans of one
    replica, one serving a plan this coordinator never made (`made`: it predates this
    coordinator) goes first, then the one `held` names, then the first by plan: the
    claimant, planned first and advertising that plan again, kept the replica. A group
    serving a plan made here that the coordinator holds no more (stale: its ranks have not
    heard the newer plan yet) does not take the replica from the ranks that hold it."""
    held = held or {}
    out: dict[int, Replica] = {}
    for rid, ms in members.items():
        plans: dict[str, list[Member]] = {}
        for m in ms:
            if m[1].replica_plan:
                plans.setdefault(m[1].replica_plan, []).append(m)
        whole: list[tuple[str, Replica]] = []
        for plan, group in sorted(plans.items()):
            size = group[0][1].replica_size
            ranks = {r.rank for _, r in group}
            alike = all(r.replica_size == size for _, r in group)
            if alike and len(group) == len(ranks) == size:
                rep = Replica(rid, size, tuple(sorted(group, key=lambda m: m[1].rank)))
                whole.append((plan, rep))
        mine = _key(held[rid]) if rid in held else None
        # a plan made here, not held now, is stale: it does not take a held replica over
        whole = [w for w in whole if mine is None or w[0] not in made or _key(w[1]) == mine]
        if whole:
            out[rid] = min(whole, key=lambda w: (w[0] in made, _key(w[1]) != mine))[1]
    return out


def _key(rep: Replica) -> frozenset[tuple[str, int, int]]:
    return frozenset((n, r.rank, r.replica_size) for n, r in rep.ranks)


def _holders(planned: Replica | None, ms: list[Member]) -> list[Member] | None:
    """The planned replica's ranks among `ms`, if every one of them still advertises as it
    was planned (node, rank, size); None otherwise."""
    if planned is None:
        return None
    want = {(n, r.rank, r.replica_size) for n, r in planned.ranks}
    have = [m for m in ms if (m[0], m[1].rank, m[1].replica_size) in want]
    return have if len(have) == len(want) == planned.size else None


def _conflict(rid: int, ms: list[Member], taken: Mapping[int, str]) -> str:
    """Why the ranks `ms` cannot make replica `rid` ("" if they can)."""
    sizes = sorted({r.replica_size for _, r in ms})
    if len(sizes) > 1:
        return f"engine replica {rid}: its ranks disagree on its size {sizes} ({_where(ms)})"
    ranks = [r.rank for _, r in ms]
    twice = sorted({k for k in ranks if ranks.count(k) > 1})
    if twice:
        return f"engine replica {rid}: engine ranks {twice} claimed more than once ({_where(ms)})"
    if len(ms) > sizes[0]:
        return (
            f"engine replica {rid} of size {sizes[0]} is claimed by {len(ms)} engine ranks "
            f"({_where(ms)})"
        )
    clash = [(n, r) for n, r in ms if r.rank in taken]
    if clash:
        n, r = clash[0]
        return (
            f"engine rank {r.rank} on {n} (replica {rid}) is already engine rank {r.rank} of "
            f"{taken[r.rank]}"
        )
    return ""
