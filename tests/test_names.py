"""The admission rule of the peer mesh (daemon/names.py), case by case; test_identity.py does
the same with real daemons and an insider's key."""

from __future__ import annotations

from weightwire.daemon.names import Names, RefusalLog, claimed_name, routing_id
from weightwire.protocol.peer import (
    AssignPlan,
    Heartbeat,
    Member,
    Membership,
    PeerHello,
    VersionAbort,
)
from weightwire.protocol.plan import NodePlan

COORD, ALICE, MALLORY = b"c" * 40, b"a" * 40, b"m" * 40
MEMBERS = {
    "host0": Member(node="host0", endpoint="tcp://h0:1", incarnation="1", public_key="c" * 40),
    "alice": Member(node="alice", endpoint="tcp://h1:1", incarnation="1", public_key="a" * 40),
}


def names(curve: bool = True) -> Names:
    return Names(curve=curve, coordinator_key=COORD, members=lambda: MEMBERS)


def beat(node: str) -> Heartbeat:
    return Heartbeat(node=node, incarnation="x")


def test_routing_ids_carry_a_name_and_a_nonce() -> None:
    assert claimed_name(routing_id("rack/gpu-1", "00ff")) == "rack/gpu-1"
    assert claimed_name(b"plain") == "plain"


def test_bound_names_speak_only_with_their_key() -> None:
    n = names()
    assert n.refusal("alice", ALICE, beat("alice")) is None
    assert n.refusal("host0", COORD, beat("host0")) is None
    assert "bound to another key" in n.refusal("host0", MALLORY, beat("host0")).reason  # type: ignore[union-attr]
    assert "alice's" in n.refusal("ghost", ALICE, beat("ghost")).reason  # type: ignore[union-attr]
    assert "bound to another key" in n.refusal("alice", COORD, beat("alice")).reason  # type: ignore[union-attr]


def test_the_body_names_the_sender() -> None:
    abort = VersionAbort(
        job="j", version=1, source_node="alice", source_rank=0, code="x", message=""
    )
    assert "speaks for alice" in names().refusal("host0", COORD, abort).reason  # type: ignore[union-attr]


def test_coordinator_only_messages() -> None:
    n = names()
    lost = Membership(members=(), lost=("alice",))
    assert n.refusal("host0", COORD, lost) is None
    assert n.refusal("alice", ALICE, lost) is not None
    plan = AssignPlan(plan=NodePlan(job="j", plan_hash="h"))
    assert "only from the coordinator" in n.refusal("ghost", MALLORY, plan).reason  # type: ignore[union-attr]


def test_unknown_names_may_only_say_hello_and_quietly() -> None:
    n = names()
    hello = PeerHello(protocol=1, member=Member(node="bob", endpoint="tcp://b:1", incarnation="1"))
    assert n.refusal("bob", b"b" * 40, hello) is None  # the coordinator binds or refuses it
    quiet = n.refusal("bob", b"b" * 40, beat("bob"))
    assert quiet is not None and not quiet.loud


def test_plaintext_checks_nothing() -> None:
    assert names(curve=False).refusal("host0", None, beat("host0")) is None


def test_refusals_are_logged_once_per_interval(capsys) -> None:  # type: ignore[no-untyped-def]
    from weightwire.daemon.names import Refusal

    log = RefusalLog(interval_s=60)
    for _ in range(100):
        log.refused("host0", MALLORY, "Heartbeat", Refusal("host0 is bound to another key"))
    assert capsys.readouterr().out.count("peer message refused") <= 1
    assert log._by[("host0", MALLORY, "host0 is bound to another key")].suppressed == 99
