"""Messages between node daemons (ZeroMQ, CURVE-authenticated in production)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .local import EngineLayout, Verdict, Version, WorldSize
from .plan import NodePlan
from .regions import RegionDescriptor, TransportEndpoints
from .tensors import DestTensor, NonNeg, SourceTensor


class PeerMsg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    req: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0


class Member(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    endpoint: str  # the node's peer socket, tcp://host:port
    incarnation: str  # changes every time the daemon starts
    transports: TransportEndpoints = TransportEndpoints()
    public_key: str = ""  # z85 CURVE key, when CURVE is on


class PeerHello(PeerMsg, frozen=True, tag="peer_hello"):
    protocol: int
    member: Member


class PeerWelcome(PeerMsg, frozen=True, tag="peer_welcome"):
    protocol: int
    coordinator: str


class RankAdvert(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of the advertising node, with what it holds or needs."""

    role: Literal["trainer", "engine"]
    rank: NonNeg
    world_size: WorldSize
    sources: tuple[SourceTensor, ...] = ()
    destinations: tuple[DestTensor, ...] = ()
    layout: EngineLayout | None = None
    regions: tuple[RegionDescriptor, ...] = ()
    slot: int = -1  # engine ranks: the immediate counter its node gave it (unique on the node)
    delta_region: int = -1  # engine ranks: the region it registered for delta payloads
    lanes: int = 1  # independent paths (NICs) its node's data plane has for this rank
    replica: int = -1  # engine ranks of an elastic job: their replica (Hello.replica)
    replica_size: int = 0  # and how many ranks that replica has
    # engine ranks of an elastic job: the replica plan the rank holds (its Expect.plan_hash;
    # "": none), so that a coordinator that restarted knows which ranks serve each replica
    replica_plan: str = ""


class Advertise(PeerMsg, frozen=True, tag="advertise"):
    """A node's complete current set of ranks for a job (replaces the previous one)."""

    node: str
    incarnation: str
    job: str
    ranks: tuple[RankAdvert, ...]
    seq: NonNeg = 0
    plan_hash: str = ""  # the plan this node holds for the job ("" = none): stale ones are re-sent


class Membership(PeerMsg, frozen=True, tag="membership"):
    members: tuple[Member, ...]
    lost: tuple[str, ...] = ()


class AssignPlan(PeerMsg, frozen=True, tag="assign_plan"):
    plan: NodePlan


Ranks = tuple[NonNeg, ...]
"""Engine ranks of a PlanProblem (an elastic replica's claimant, a replica that cannot be
planned): the node's plan and its other ranks stay."""


class PlanProblem(PeerMsg, frozen=True, tag="plan_problem"):
    """The coordinator could not make a plan for `job`; every rank of it is told why."""

    job: str
    code: str
    message: str
    ranks: Ranks = ()  # only these engine ranks here are refused; empty: the whole job
    cleared: bool = False  # these `ranks` are no longer refused (their claim conflicts no more)
    # the job's plan is withdrawn, no fault: it lacks ranks (one left; `message` names
    # them). Its nodes drop the plan and wait for the next, as for a first plan.
    withdrawn: bool = False


class Heartbeat(PeerMsg, frozen=True, tag="heartbeat"):
    node: str
    incarnation: str
    seq: NonNeg = 0


class VersionStart(PeerMsg, frozen=True, tag="version_start"):
    """A source rank starts writing `version` to this node's engine ranks."""

    job: str
    version: Version
    source_node: str
    source_rank: NonNeg


class VersionAbort(PeerMsg, frozen=True, tag="version_abort"):
    """A source gave up on `version`: the destinations must fail it, never complete it."""

    job: str
    version: Version
    source_node: str
    source_rank: NonNeg
    code: str
    message: str


class VersionVerdict(PeerMsg, frozen=True, tag="version_verdict"):
    """An engine rank's outcome of `version` in a delta-capable plan, to every source node:
    its sources send it a dense version next unless it holds this one (ok)."""

    job: str
    version: Version
    verdict: Verdict


class LandedPart(msgspec.Struct, frozen=True, kw_only=True):
    """What one bucket wrote to one engine rank (its immediate `slot`): the ranges its
    trailer's checksum covers and its delta payloads (offset in the delta area, bytes)."""

    slot: NonNeg
    ranges: tuple[tuple[NonNeg, NonNeg, NonNeg, NonNeg, NonNeg], ...] = ()
    payloads: tuple[tuple[NonNeg, NonNeg], ...] = ()


class BucketLanded(PeerMsg, frozen=True, tag="bucket_landed"):
    """Source → destination node, delta-capable plans: every write of `bucket` of version
    `version` from rank `source_rank` landed; its engine ranks may apply and checksum it
    before the version's last byte (`ApplyBucket`)."""

    job: str
    version: Version
    source_node: str
    source_rank: NonNeg
    bucket: NonNeg
    parts: tuple[LandedPart, ...] = ()


class TransportSignal(PeerMsg, frozen=True, tag="transport_signal"):
    """Opaque bring-up data between two nodes' instances of one transport (e.g. QP numbers)."""

    transport: str
    node: str
    payload: bytes
    reply: bool = False


class PeerError(PeerMsg, frozen=True, tag="peer_error"):
    code: str
    message: str


class StatusQuery(PeerMsg, frozen=True, tag="status_query"):
    """`weightwire status --cluster` on some node: the receiver answers with its status."""


class StatusAnswer(PeerMsg, frozen=True, tag="status_answer"):
    body: dict[str, object]


PeerMessage = (
    PeerHello
    | PeerWelcome
    | Advertise
    | Membership
    | AssignPlan
    | PlanProblem
    | Heartbeat
    | VersionStart
    | VersionAbort
    | VersionVerdict
    | BucketLanded
    | TransportSignal
    | PeerError
    | StatusQuery
    | StatusAnswer
)
