"""A rank's session with its daemon, and the checks on what it declares."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightwire.protocol import check_protocol
from weightwire.protocol.errors import ErrorCode, ProtocolError, RegistrationError
from weightwire.protocol.local import EngineLayout, Hello
from weightwire.protocol.tensors import ITEMSIZE, DestTensor, SourceTensor

from .regions import Region


@dataclass(eq=False)
class Session:
    identity: bytes
    hello: Hello
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    sources: dict[str, SourceTensor] = field(default_factory=dict)
    destinations: dict[str, DestTensor] = field(default_factory=dict)
    layout: EngineLayout | None = None
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        return self.hello.role

    @property
    def rank(self) -> int:
        return self.hello.rank

    @property
    def job(self) -> str:
        return self.hello.job

    @property
    def label(self) -> str:
        return f"{self.role} rank {self.rank} (pid {self.hello.pid})"

    def declare_sources(self, tensors: tuple[SourceTensor, ...]) -> None:
        if self.role != "trainer":
            raise RegistrationError(f"a {self.role} session cannot declare source tensors")
        new: dict[str, SourceTensor] = {}
        for t in tensors:
            if t.name in self.sources or t.name in new:
                raise RegistrationError(
                    f"tensor {t.name} is already registered by this rank", code=ErrorCode.DUPLICATE
                )
            held = t.held()
            if not held.within(t.shape):
                raise RegistrationError(
                    f"tensor {t.name}: held box offsets {list(held.offsets)} sizes "
                    f"{list(held.sizes)} do not fit its shape {list(t.shape)}",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            new[t.name] = t
        self.sources.update(new)

    def declare_destinations(
        self,
        tensors: tuple[DestTensor, ...],
        layout: EngineLayout | None,
        regions: dict[int, Region],
    ) -> None:
        if self.role != "engine":
            raise RegistrationError(f"a {self.role} session cannot declare destination tensors")
        new: dict[str, DestTensor] = {}
        for t in tensors:
            if t.name in self.destinations or t.name in new:
                raise RegistrationError(
                    f"tensor {t.name} is already registered by this rank", code=ErrorCode.DUPLICATE
                )
            region = regions.get(t.region)
            if region is None or region.session != self.id:
                raise RegistrationError(
                    f"tensor {t.name} is placed in region {t.region}, which this rank did not "
                    f"register",
                    code=ErrorCode.UNKNOWN_REGION,
                )
            if t.offset % ITEMSIZE[t.dtype]:
                raise RegistrationError(
                    f"tensor {t.name} at offset {t.offset} is not aligned to its {t.dtype} elements"
                )
            if t.offset + t.nbytes > region.local.length:
                raise RegistrationError(
                    f"tensor {t.name} ({t.dtype}{list(t.shape)}, {t.nbytes} bytes at offset "
                    f"{t.offset}) overruns region {t.region} of {region.local.length} bytes",
                    code=ErrorCode.OUT_OF_BOUNDS,
                )
            new[t.name] = t
        spans = sorted(
            (t.region, t.offset, t.offset + t.nbytes, t.name)
            for t in [*self.destinations.values(), *new.values()]
        )
        for a, b in itertools.pairwise(spans):
            if a[0] == b[0] and b[1] < a[2]:
                raise RegistrationError(
                    f"tensors {a[3]} and {b[3]} overlap in region {a[0]}", code=ErrorCode.INVALID
                )
        self.destinations.update(new)
        if layout is not None:
            self.layout = layout


def check_hello(identity: bytes, hello: Hello, sessions: Mapping[bytes, Session]) -> None:
    """A connection's hello may open a session: a protocol this daemon speaks, a first
    hello, and (but for admin) a rank not registered yet that agrees with its job's others."""
    check_protocol(hello.protocol, f"rank (pid {hello.pid})")
    if identity in sessions:
        raise ProtocolError("this connection already said hello", code=ErrorCode.DUPLICATE)
    if hello.role != "admin":
        for s in sessions.values():
            if (s.job, s.role) != (hello.job, hello.role):
                continue
            if s.rank == hello.rank:
                raise ProtocolError(
                    f"{hello.role} rank {hello.rank} of job {hello.job!r} is already "
                    f"registered here (pid {s.hello.pid})",
                    code=ErrorCode.DUPLICATE,
                )
            if s.hello.world_size != hello.world_size:
                raise ProtocolError(
                    f"world size {hello.world_size} disagrees with {s.label}'s "
                    f"{s.hello.world_size}",
                    code=ErrorCode.INVALID,
                )
        if hello.rank >= hello.world_size:
            raise ProtocolError(
                f"rank {hello.rank} is not below world size {hello.world_size}",
                code=ErrorCode.INVALID,
            )
