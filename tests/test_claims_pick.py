"""Which ranks keep an elastic replica when the coordinator's own pick and the ranks'
adverts disagree (`daemon.claims`): pure functions, no daemons (the daemons' side is
tests/test_replica_claims.py)."""

from __future__ import annotations

from weightwire.daemon.claims import Refusal, claims
from weightwire.daemon.elastic import Replica
from weightwire.protocol.peer import Advertise, RankAdvert


def rank(r: int, plan: str = "") -> RankAdvert:
    return RankAdvert(
        role="engine", rank=r, world_size=2, replica=0, replica_size=1, replica_plan=plan
    )


def adverts(**ranks: RankAdvert) -> dict[str, Advertise]:
    return {
        node: Advertise(node=node, incarnation="i", job="j", ranks=(r,))
        for node, r in ranks.items()
    }


def refused_nodes(refusals: list[Refusal]) -> set[str]:
    return {n for f in refusals for n in f.ranks}


def test_the_ranks_serving_a_replica_plan_win_over_the_coordinators_pick() -> None:
    """A coordinator that restarted heard the claimant (host2) first and planned it as
    replica 0; host1 comes back serving replica 0 under the plan it holds. host1 keeps the
    replica, the claimant is refused (it used to be the other way round)."""
    claimant = rank(1)
    held = {0: Replica(0, 1, (("host2", claimant),))}
    replicas, refused = claims(adverts(host1=rank(0, "X"), host2=claimant), held)
    assert [n for n, _ in replicas[0].ranks] == ["host1"]
    assert refused_nodes(refused) == {"host2"}


def test_the_coordinators_pick_stays_while_no_other_ranks_serve_a_plan_of_it() -> None:
    """A replica this coordinator planned (its ranks advertise no plan yet) keeps it against
    a claimant that holds none either."""
    holder = rank(0)
    held = {0: Replica(0, 1, (("host1", holder),))}
    replicas, refused = claims(adverts(host1=holder, host2=rank(1)), held)
    assert [n for n, _ in replicas[0].ranks] == ["host1"]
    assert refused_nodes(refused) == {"host2"}


def test_of_two_groups_serving_plans_of_a_replica_one_from_before_the_coordinator_wins() -> None:
    """The claimant, planned first by the restarted coordinator, advertises that plan (B,
    made here) by the time host1 comes back serving A (made by the coordinator before):
    host1 keeps the replica (the claimant, held and serving a plan, used to keep it)."""
    held = {0: Replica(0, 1, (("host2", rank(1, "B")),))}
    replicas, refused = claims(adverts(host1=rank(0, "A"), host2=rank(1, "B")), held, {"B"})
    assert [n for n, _ in replicas[0].ranks] == ["host1"]
    assert refused_nodes(refused) == {"host2"}


def test_of_two_groups_serving_plans_made_here_the_one_held_keeps_it() -> None:
    """Both plans were made by this coordinator (one is stale: its ranks have not heard the
    newer plan yet): the replica it holds keeps it, whichever plan sorts first."""
    held = {0: Replica(0, 1, (("host2", rank(1, "B")),))}
    replicas, refused = claims(adverts(host1=rank(0, "A"), host2=rank(1, "B")), held, {"A", "B"})
    assert [n for n, _ in replicas[0].ranks] == ["host2"]
    assert refused_nodes(refused) == {"host1"}


def test_a_stale_plan_made_here_does_not_take_a_held_replica() -> None:
    """The claimant still advertises the plan made for it (B) after the replica went back
    to host1, whose rank advertises none now (its plan withdrawn meanwhile): host1 keeps it."""
    held = {0: Replica(0, 1, (("host1", rank(0)),))}
    replicas, refused = claims(adverts(host1=rank(0), host2=rank(1, "B")), held, {"A", "B"})
    assert [n for n, _ in replicas[0].ranks] == ["host1"]
    assert refused_nodes(refused) == {"host2"}
