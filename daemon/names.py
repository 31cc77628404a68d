"""Which CURVE key may speak as which node.

A peer's node name is a claim (the name part of its ZeroMQ routing id); the key its
connection authenticated with (ZAP user id) is a fact. A message is acted on only when the
two agree:

- the coordinator binds a name to the key of the first hello that claims it, for as long as
  that name is a member (a second key claiming a member's name, or one key claiming two
  names, is refused); every other node learns the bindings from the coordinator's
  membership, which it accepts only from the coordinator's key (set in its configuration);
- plan assignment, membership, plan problems and welcomes come only from the coordinator's
  key;
- a name a message carries in its body (a heartbeat's node, a version's source node, ...)
  is the name it came under.

Plaintext mode (`insecure = true`) has no keys: names are claims there, and nothing is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from weightwire.protocol.peer import (
    Advertise,
    AssignPlan,
    BucketLanded,
    Heartbeat,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    PlanProblem,
    TransportSignal,
    VersionAbort,
    VersionStart,
    VersionVerdict,
)

from .lograte import Throttled

log = structlog.get_logger("weightwire.daemon.names")

COORDINATOR_ONLY = (PeerWelcome, Membership, AssignPlan, PlanProblem)
SEPARATOR = "/"  # routing ids are NAME/NONCE: nobody else knows the nonce, so none can take it


def routing_id(node: str, nonce: str) -> bytes:
    return f"{node}{SEPARATOR}{nonce}".encode()


def claimed_name(routing_id: bytes) -> str:
    """The node name a routing id claims (the whole id when it carries no nonce)."""
    text = routing_id.decode(errors="replace")
    name, sep, _ = text.rpartition(SEPARATOR)
    return name if sep else text


def body_name(msg: PeerMessage) -> str | None:
    """The node a message says it comes from, if it says."""
    match msg:
        case PeerHello(member=member):
            return member.node
        case Heartbeat(node=node) | Advertise(node=node) | TransportSignal(node=node):
            return node
        case (
            VersionStart(source_node=node)
            | VersionAbort(source_node=node)
            | BucketLanded(source_node=node)
        ):
            return node
        case VersionVerdict(verdict=verdict):
            # an engine rank's outcome, said by its node only: a forged "ok" from another
            # member finished a publish while the engine rank failed the version
            return verdict.node
    return None


@dataclass(frozen=True)
class Refusal:
    reason: str
    loud: bool = True  # a mismatch (warning); False: merely not known yet (debug)


@dataclass
class Names:
    """The admission check of the peer mesh. `members` gives the current bindings: the
    coordinator's own member table on the coordinator, the last membership elsewhere."""

    curve: bool
    coordinator_key: bytes | None
    members: Callable[[], Mapping[str, Member]] = dict

    def key_of(self, node: str) -> bytes | None:
        m = self.members().get(node)
        return m.public_key.encode() if m is not None and m.public_key else None

    def holder(self, key: bytes) -> str | None:
        text = key.decode()
        return next((m.node for m in self.members().values() if m.public_key == text), None)

    def speaks_as(self, claimed: str, key: bytes | None) -> bool:
        """Whether `key` may speak as `claimed` by the bindings alone (no message at hand)."""
        if not self.curve:
            return True
        bound = self.key_of(claimed)
        return key is not None and (bound == key or (bound is None and key == self.coordinator_key))

    def refusal(self, claimed: str, key: bytes | None, msg: PeerMessage) -> Refusal | None:
        """Why a message from `key` under the name `claimed` must not be acted on (None: it may)."""
        if not self.curve:
            return None
        if key is None:
            return Refusal("the connection has no authenticated key")
        said = body_name(msg)
        if said is not None and said != claimed:
            return Refusal(f"the message speaks for {said} but comes as {claimed}")
        from_coordinator = key == self.coordinator_key
        if isinstance(msg, COORDINATOR_ONLY) and not from_coordinator:
            return Refusal(f"{type(msg).__name__} is accepted only from the coordinator")
        bound = self.key_of(claimed)
        if bound is not None:
            return None if bound == key else Refusal(f"{claimed} is bound to another key")
        holder = self.holder(key)
        if holder is not None and holder != claimed:
            return Refusal(f"this key is {holder}'s")
        if from_coordinator or isinstance(msg, PeerHello | PeerError):
            return None  # a hello is the coordinator's to bind or refuse; errors are only logged
        return Refusal(f"{claimed} is not a member known here", loud=False)


@dataclass
class RefusalLog:
    """One warning per (name, key, reason) per interval: a flood of forgeries is one line,
    with the count of those held back (`suppressed`)."""

    interval_s: float = 10.0
    _by: dict[tuple[str, bytes | None, str], Throttled] = field(default_factory=dict)

    def refused(self, claimed: str, key: bytes | None, what: str, refusal: Refusal) -> None:
        fields = {
            "peer": claimed,
            "key": key.decode(errors="replace") if key else None,
            "message": what,
            "reason": refusal.reason,
        }
        if not refusal.loud:
            log.debug("peer message refused", **fields)
            return
        k = (claimed, key, refusal.reason)
        if k not in self._by and len(self._by) >= 4096:  # bounded however many names are made up
            self._by.clear()
        throttle = self._by.setdefault(k, Throttled(self.interval_s))
        throttle.emit(log.warning, "peer message refused", **fields)
