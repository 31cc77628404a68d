"""Messages on a daemon's local socket, between the daemon and the ranks of its host: the
handshake, registration, liveness and admin here; a trainer's versions in `localtrainer`,
an engine's in `localengine`, what they all share in `localbase`. Every name is also
importable from here, and `LocalMessage` is the socket's one tagged union.

Requests carry `req`, a number the client picks; the reply to a request carries
the same `req`. Notifications from the daemon (`req` = 0) are unsolicited.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .localbase import (
    MAX_WORLD,
    SOCKET_ENV,
    SOCKET_PATH,
    LocalMsg,
    Req,
    Role,
    Version,
    WorldSize,
)
from .localengine import (
    Applied,
    ApplyBucket,
    ApplyVersion,
    VersionComplete,
    VersionFailed,
    WaitVersion,
)
from .localtrainer import (
    AbortVersion,
    BeginVersion,
    BucketReady,
    BucketsIssued,
    BucketsLanded,
    GetPlan,
    PlanReply,
    PublishResult,
    ReplicaOutcome,
    TrailersReady,
    Verdict,
)
from .tensors import DestTensor, Name, NonNeg, SourceTensor

__all__ = [
    "MAX_WORLD",
    "SOCKET_ENV",
    "SOCKET_PATH",
    "AbortVersion",
    "Applied",
    "ApplyBucket",
    "ApplyVersion",
    "BeginVersion",
    "BucketReady",
    "BucketsIssued",
    "BucketsLanded",
    "CudaRegion",
    "DeclareDestinations",
    "DeclareSources",
    "EngineLayout",
    "Error",
    "GetPlan",
    "Goodbye",
    "Hello",
    "LocalMessage",
    "LocalMsg",
    "Ok",
    "Ping",
    "PlanReply",
    "Pong",
    "PublishResult",
    "RegionRegistered",
    "RegisterRegion",
    "RemapRegion",
    "ReplicaOutcome",
    "Req",
    "Role",
    "StatusReply",
    "StatusRequest",
    "TrailersReady",
    "Verdict",
    "Version",
    "VersionComplete",
    "VersionFailed",
    "WaitVersion",
    "Welcome",
    "WorldSize",
]

# --- handshake -------------------------------------------------------------


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


# --- liveness and admin ----------------------------------------------------


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
