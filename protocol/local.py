"""Messages on a daemon's local socket, between the daemon and the ranks of its host.

Requests carry `req`, a number the client picks; the reply to a request carries
the same `req`. Notifications from the daemon (`req` = 0) are unsolicited.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .plan import RankPlan
from .tensors import DestTensor, Name, NonNeg, SourceTensor

SOCKET_PATH = "/run/weightwire/weightwired.sock"  # where the daemon listens by default
SOCKET_ENV = "WEIGHTWIRE_SOCKET"  # the variable that points clients (and the cli) elsewhere

Role = Literal["trainer", "engine", "admin"]
Req = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MAX_WORLD = 1 << 16
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]
"""Ranks of one role in a job: far beyond any cluster's, small enough that the coordinator
can list which are missing (a world of 2^40 once held its event loop for hours)."""


class LocalMsg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    req: Req = 0


# --- handshake -------------------------------------------------------------


class Hello(LocalMsg, frozen=True, tag="hello"):
    protocol: int
    role: Role
    rank: NonNeg = 0
    world_size: WorldSize = 1
    job: Name = "default"
    pid: int = 0
    client: str = ""
    device_uuid: str = ""  # the GPU this rank uses ("" for none): picks its NICs (lanes)
    # engine ranks of an elastic job: the replica (one engine, all its ranks) this rank is
    # part of, and how many ranks that replica has (-1 / 0: not elastic)
    replica: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 20)] = -1
    replica_size: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)] = 0


class Welcome(LocalMsg, frozen=True, tag="welcome"):
    protocol: int
    node: str
    session: str
    daemon_version: str = ""
    region_dir: str = ""  # where the rank makes its shared region files ("": /dev/shm)
    max_message_bytes: int = 0  # the largest request the daemon takes (0: not said)
    fd_socket: str = ""  # where the rank passes file descriptors (memory.fdpass; "": nowhere)
    # what this daemon does that an older one would silently not do (a field it would
    # ignore): "pack_gate" (`BeginVersion.gate_offset`)
    features: tuple[str, ...] = ()


# --- registration ----------------------------------------------------------


class CudaRegion(msgspec.Struct, frozen=True, kw_only=True):
    """GPU memory of a rank: its allocation's CUDA IPC handle and where the region starts.

    VMM memory (cuMemCreate: SGLang's memory saver, expandable segments) has no IPC handle
    (`ipc_handle` empty): its allocations, `vmm_sizes` bytes each and mapped back to back
    from the first one's base, were passed to the daemon's `fd_socket` as POSIX fds, in
    that order, under `vmm_token`; `offset` counts from the first one's base."""

    device_uuid: str
    ipc_handle: bytes
    offset: NonNeg = 0
    vmm_token: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    vmm_sizes: Annotated[
        tuple[Annotated[int, msgspec.Meta(gt=0)], ...], msgspec.Meta(max_length=250)
    ] = ()


class RegisterRegion(LocalMsg, frozen=True, tag="register_region"):
    """Memory the rank owns, mapped by the daemon once: a /dev/shm file (`path`, cpu) or
    GPU memory (`cuda`, gpu)."""

    length: Annotated[int, msgspec.Meta(gt=0)]
    path: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    purpose: Literal["staging", "weights", "sources", "delta"] = "weights"
    kind: Literal["cpu", "gpu"] = "cpu"
    cuda: CudaRegion | None = None


class RegionRegistered(LocalMsg, frozen=True, tag="region_registered"):
    region: NonNeg


class RemapRegion(LocalMsg, frozen=True, tag="remap_region"):
    """The GPU memory behind a registered region of this rank changed, its id and layout
    kept (SGLang's release_memory_occupation / resume_memory_occupation). `cuda` None: it
    is released; the daemon drops its mapping, and writes into the region fail (their
    version with them) until it is remapped. `cuda` given: the daemon maps that memory
    instead of what it had. Replied to with `Ok`."""

    region: NonNeg
    cuda: CudaRegion | None = None


class DeclareSources(LocalMsg, frozen=True, tag="declare_sources"):
    """A trainer rank's tensors: global name, dtype, shape, and the box it holds."""

    tensors: tuple[SourceTensor, ...]


class EngineLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How an engine rank's tensors are sharded, for rules that derive recipes by name."""

    family: str = ""
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    replica: int = 0
    model: dict[str, Any] = {}  # the model's config (HF config.json) for the rules
    dest_dtype: str = ""


class DeclareDestinations(LocalMsg, frozen=True, tag="declare_destinations"):
    """An engine rank's receive tensors, placed in its registered regions."""

    tensors: tuple[DestTensor, ...]
    layout: EngineLayout | None = None


class Ok(LocalMsg, frozen=True, tag="ok"):
    detail: str = ""


class Error(LocalMsg, frozen=True, tag="error"):
    code: str
    message: str


# --- trainer ---------------------------------------------------------------


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


# --- engine ----------------------------------------------------------------


class WaitVersion(LocalMsg, frozen=True, tag="wait_version"):
    version: Version
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 300.0


class VersionComplete(LocalMsg, frozen=True, tag="version_complete"):
    rank: NonNeg
    version: Version
    nbytes: NonNeg = 0
    seconds: float = 0.0


class VersionFailed(LocalMsg, frozen=True, tag="version_failed"):
    rank: NonNeg
    version: Version
    code: str
    message: str


class ApplyVersion(LocalMsg, frozen=True, tag="apply_version"):
    """Every write of `version` has landed at engine rank `rank`: apply the delta payloads
    in its delta area (`region`), check the trailers (at `trailers`: offset, capacity), and
    answer with `Applied`. The version is complete only after that."""

    rank: NonNeg
    version: Version
    region: NonNeg
    trailers: tuple[tuple[NonNeg, NonNeg], ...]


class ApplyBucket(LocalMsg, frozen=True, tag="apply_bucket"):
    """Every write of bucket `bucket` of sender rank `sender` to engine rank `rank` landed
    (the source saw them all land) before the version's end: apply its payloads (at
    `payloads`: offset, bytes in the delta area `region`) and checksum its `ranges`
    (region, offset, length, count, stride) now, overlapped with the buckets still on
    their way. No reply: `ApplyVersion` finishes the version, checking the trailers with
    these per-range checksums (and computing any a bucket's message did not bring)."""

    rank: NonNeg
    version: Version
    region: NonNeg
    sender: NonNeg
    bucket: NonNeg
    ranges: tuple[tuple[NonNeg, NonNeg, NonNeg, NonNeg, NonNeg], ...] = ()
    payloads: tuple[tuple[NonNeg, NonNeg], ...] = ()


class Applied(LocalMsg, frozen=True, tag="applied"):
    """An engine rank applied and verified `version` (ok), or why not. No reply."""

    rank: NonNeg
    version: Version
    ok: bool
    code: str = ""
    message: str = ""
    delta_bytes: NonNeg = 0
    seconds: float = 0.0


# --- liveness and admin ----------------------------------------------------


class Ping(LocalMsg, frozen=True, tag="ping"):
    """Sent by every client once a second; a session silent for longer than the daemon's
    session timeout is released with everything it registered."""


class Pong(LocalMsg, frozen=True, tag="pong"):
    session: str = ""


class Goodbye(LocalMsg, frozen=True, tag="goodbye"):
    """The rank is leaving: release its session now. No reply."""


class StatusRequest(LocalMsg, frozen=True, tag="status"):
    cluster: bool = False  # every member's status, gathered by this daemon over the mesh


class StatusReply(LocalMsg, frozen=True, tag="status_reply"):
    """A snapshot for humans and tools; `body` is the JSON-able status document."""

    body: dict[str, object]


LocalMessage = (
    Hello
    | Welcome
    | RegisterRegion
    | RegionRegistered
    | RemapRegion
    | DeclareSources
    | DeclareDestinations
    | Ok
    | Error
    | GetPlan
    | PlanReply
    | BeginVersion
    | BucketReady
    | BucketsLanded
    | BucketsIssued
    | TrailersReady
    | AbortVersion
    | PublishResult
    | WaitVersion
    | VersionComplete
    | VersionFailed
    | ApplyVersion
    | ApplyBucket
    | Applied
    | StatusRequest
    | StatusReply
    | Ping
    | Pong
    | Goodbye
)
