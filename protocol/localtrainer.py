"""The local socket's messages of a trainer rank's versions: its plan, a version begun,
its buckets ready and landed, its trailers, and the version's result (`PublishResult`,
with each engine rank's verdict)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .localbase import LocalMsg, Version
from .plan import RankPlan
from .tensors import NonNeg


class GetPlan(LocalMsg, frozen=True, tag="get_plan"):
    """Reply when this rank's plan exists (or with NOT_READY after `timeout_s`); with
    `after_plan`, a plan other than that one (the rank declared tensors since it got it,
    and the plan it had does not know them)."""

    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    after_plan: Annotated[str, msgspec.Meta(max_length=128)] = ""


class PlanReply(LocalMsg, frozen=True, tag="plan"):
    plan: RankPlan


class BeginVersion(LocalMsg, frozen=True, tag="begin_version"):
    """`staging_buckets` > 0: the rank packs into a ring of that many slots
    (`protocol.plan.staging_ring`), and is told as each bucket's writes have all finished
    (`BucketsLanded`), so that it can pack another bucket into that slot. 0: the whole send
    is staged at the plan's offsets."""

    version: Version
    plan_hash: str
    staging_buckets: NonNeg = 0
    slot_events: bool = False
    """The rank can wait on the GPU for a slot (CUDA IPC events): a bucket whose writes are
    all cuda copies is also reported `BucketsIssued`, once they are all queued."""
    fence_offset: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """>= 0: GPU staging's slot counters, one 32-bit word per ring slot from this byte
    offset of the staging region (past the ring's bytes). The rank's packing stream waits
    on the GPU (cuStreamWaitValue32, GEQ) for slot s's counter to reach bucket b's sequence
    number, `fence_base + b + 1` (mod 2**32), before packing the slot's next bucket; the
    daemon writes it once every read of bucket b's slot is done: on the GPU after its cuda
    copies (cuStreamWriteValue32), or when the bucket lands. The rank's thread never waits
    for the daemon (no `BucketsIssued`). A failed version's counters are all set to its last
    sequence number, releasing every wait. -1: no counters."""
    fence_base: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0
    gate_offset: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """>= 0: GPU staging's pack counter, one 32-bit word at this byte offset of the staging
    region (past the ring's bytes and its slot counters). The rank's packing stream writes
    bucket b's sequence number there (`fence_base + b + 1`, mod 2**32, cuStreamWriteValue32)
    right after b's packing, and the rank sends `BucketReady` as soon as that is queued,
    not once it is done: the daemon's copies of b wait on the GPU for the counter
    (cuStreamWaitValue32, GEQ) before reading staging (any other transport: the daemon
    waits for it). Buckets are packed in order, so one word serves them all. A failed
    version's counter is set to its last sequence number by the daemon, so that no wait of
    its own is left behind (the rank may be gone). -1: BucketReady follows the packing."""


class BucketReady(LocalMsg, frozen=True, tag="bucket_ready"):
    """Bucket `bucket` of `version` is packed in staging, and so are the buckets in `more`
    (those that finished packing meanwhile, in one message): post their writes. No reply.
    With a pack counter (`BeginVersion.gate_offset`): their packing is queued on the GPU,
    the counter tells when it is done."""

    version: Version
    bucket: NonNeg
    more: tuple[NonNeg, ...] = ()
    delta: tuple[tuple[NonNeg, NonNeg, NonNeg], ...] = ()  # (bucket, delta slot, payload bytes)
    # of these buckets, those the rank packed straight into their destinations (colocated:
    # the same GPU), their bytes visible there: the daemon only delivers their immediates
    in_place: tuple[NonNeg, ...] = ()


class TrailersReady(LocalMsg, frozen=True, tag="trailers_ready"):
    """The rank's trailers of `version` (the plan's, in order, `lengths` bytes each) are
    written in staging: post them, the version's last writes. No reply."""

    version: Version
    lengths: tuple[NonNeg, ...]


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine rank (on `node`, immediate slot `slot`) made of a version."""

    node: str
    slot: NonNeg
    rank: NonNeg
    ok: bool
    code: str = ""
    message: str = ""


class BucketsLanded(LocalMsg, frozen=True, tag="buckets_landed"):
    """Every write of these buckets of `version` has finished: their staging slots are free.
    Sent only to a rank that packs into a ring (`BeginVersion.staging_buckets` > 0)."""

    version: Version
    buckets: tuple[NonNeg, ...]


class BucketsIssued(LocalMsg, frozen=True, tag="buckets_issued"):
    """Every write of these buckets of `version` is a cuda copy, queued on its stream, and
    each stream has recorded one of `events` (CUDA IPC event handles, 64 bytes each) after
    its last copy reading the buckets' staging slot. The rank may pack the slot's next
    bucket once its packing stream waits on those events (no need to wait for the landing,
    `BucketsLanded`, which still follows). Sent only to a rank that asked
    (`BeginVersion.slot_events`); an event is recorded again only after the rank posts
    the slot's next bucket."""

    version: Version
    buckets: tuple[NonNeg, ...]
    events: tuple[bytes, ...] = ()


class AbortVersion(LocalMsg, frozen=True, tag="abort_version"):
    version: Version
    reason: str = ""


class ReplicaOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What became of one engine replica's writes of a version (elastic jobs): all landed
    (ok), or dropped with the first cause (a dead replica fails only itself)."""

    replica: int
    ok: bool
    code: str = ""
    message: str = ""


class PublishResult(LocalMsg, frozen=True, tag="publish_result"):
    """All of a rank's writes of `version` landed (ok) or the version failed (code/message)."""

    version: Version
    ok: bool
    nbytes: NonNeg = 0
    writes: NonNeg = 0
    seconds: float = 0.0
    code: str = ""
    message: str = ""
    transfer_seconds: float = 0.0  # from the first write posted to the last one landed
    buckets: tuple[tuple[float, float], ...] = ()  # per bucket: (posted, landed), wall clock
    verdicts: tuple[Verdict, ...] = ()  # delta-capable plans: each engine rank's outcome
    delta_bytes: NonNeg = 0  # of nbytes, those of delta payloads and trailers
    replicas: tuple[ReplicaOutcome, ...] = ()  # elastic jobs: each engine replica's outcome
    timeline: dict[str, float] = {}
    """The version's first events on the daemon, seconds after it accepted the version:
    first_ready (a BucketReady received), first_routed (its writes prepared), first_issued
    (a first copy issued), first_seen (its completion seen by the completion thread),
    first_finished (handed back to the loop), first_landed (a whole bucket landed)."""
