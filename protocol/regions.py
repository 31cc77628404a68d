"""Region descriptors: memory a transport can read or write, as peers see it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .tensors import NonNeg

RegionKind = Literal["cpu", "gpu"]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries the full uint64 range


class TcpKey(msgspec.Struct, frozen=True, kw_only=True):
    """What a tcp writer must present: the region's random key (tcp's rkey)."""

    rkey: U64


class VerbsKey(msgspec.Struct, frozen=True, kw_only=True):
    """One NIC's registration of a region."""

    device: str
    addr: U64
    rkey: Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class CudaKey(msgspec.Struct, frozen=True, kw_only=True):
    """A same-host GPU region: the CUDA IPC handle of its allocation and the offset in it."""

    host_id: str
    device_uuid: str
    ipc_handle: bytes
    offset: NonNeg = 0


class RegionKeys(msgspec.Struct, frozen=True, kw_only=True):
    tcp: TcpKey | None = None
    verbs: tuple[VerbsKey, ...] = ()
    cuda: CudaKey | None = None


class RegionDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """A region as advertised to peers. Keys only ever go to authenticated peers."""

    id: NonNeg
    node: str
    kind: RegionKind
    length: NonNeg
    keys: RegionKeys = RegionKeys()


class TcpEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    streams: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4


class VerbsEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    devices: tuple[str, ...] = ()
    gids: tuple[str, ...] = ()


class CudaEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    host_id: str
    channel: str = ""  # Unix datagram socket where the node takes immediates of cuda writes


class TransportEndpoints(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach a node's data plane, per transport it runs."""

    tcp: TcpEndpoint | None = None
    verbs: VerbsEndpoint | None = None
    cuda: CudaEndpoint | None = None
