"""The transport contract every data plane implements (tcp, verbs, cuda).

Its core is two calls, NIXL's shape:

    prepared = transport.prepare([WriteRequest(src, src_offset, dst, dst_offset, length, imm)])
    errors = await transport.post(prepared, imms)

`prepare` checks and resolves writes once (a bucket's, for every version); `post` issues
them with new immediates, `imms[i]` for write i, and resolves once every one has finished,
with None or the error of each, in order. `write(request)` is one write, posted at once:
it returns once the write has finished and raises its error.

A write resolves when the bytes are in the destination's memory (which implies the
source buffer may be reused), and delivers `imm` at the destination, through the handler
given to `start`, only after those bytes are visible there. A strided write (`count`
blocks of `length` bytes, `src_stride`/`dst_stride` apart) is one write: one immediate,
after every block is visible. A write that cannot be done fails with a `TransferError`
subclass naming the cause; the destination never sees the immediate of a refused or
failed write. A write refused when prepared is refused by every post.

Fencing: `fence(node)` is how a destination stops a peer's writes before it tells anyone
that a version failed or that the peer is lost. Once it returns, no byte of a write that
`node` posted before the call lands in this node's regions, however late the peer sends it
(a writer paused for seconds and resumed included), and no immediate of it is delivered.
Paths the peer opens afterwards work again (the next version). Writes whose immediate a
receiver can see before their bytes (tcp) are also checked against `set_admission`'s
predicate, so a failed version's writes are refused even on a fresh path.

Transports are created and driven on the daemon's event loop. Blocking work
(sockets, verbs polling, CUDA copies) runs on threads of the transport's own, which
hand completions back to the loop.

Timing: a caller may set `POST_STAMPS` to a dict around a `post`; a transport that keeps
stamps (cuda) puts there, once each, `time.monotonic()` of the post's first copy issued
("issued"), its first completion seen by its completion thread ("seen") and handed back
on the loop ("finished"). Others leave it empty.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, final, runtime_checkable

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.protocol.plan import check_blocks, span
from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TransportEndpoints

ImmHandler = Callable[[int, str], None]
"""Called on the event loop as `handler(imm, source_node)` once a write's bytes have landed."""

Admit = Callable[[str, int], bool]
"""`admit(source_node, imm)`: False when the write carrying `imm` belongs to something the
destination has failed (its bytes must not land)."""

Signal = Callable[[str, bytes], Awaitable[bytes]]
"""Sends an opaque bring-up message to a node's instance of this transport, returns its reply."""

POST_STAMPS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "weightwire_post_stamps", default=None
)
"""Set by a caller around `post` to learn when its copies were issued and completed (see the
module docstring); None: nobody asks."""


@dataclass(eq=False)
class LocalRegion:
    """Memory on this node that a transport may read (source) or write (destination)."""

    id: int
    kind: Literal["cpu", "gpu"]
    length: int
    view: memoryview | None = None  # host-addressable bytes (cpu regions)
    fd: int | None = None  # a file descriptor backing it: shm file (cpu), dma-buf (gpu)
    address: int = 0  # virtual address (cpu) or device pointer (gpu)
    device: int | None = None  # CUDA device ordinal of a gpu region
    owner: str = ""  # who it belongs to, for logs
    extra: dict[str, object] = field(default_factory=dict)

    def check(self, offset: int, length: int, what: str) -> None:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RegionError(
                f"{what} [{offset}, {offset + length}) is outside region {self.id} "
                f"of {self.length} bytes",
                code=ErrorCode.OUT_OF_BOUNDS,
            )


@dataclass(frozen=True, slots=True)
class WriteRequest:
    """One write: `length` bytes from `src` at `src_offset` into `dst` at `dst_offset`
    (`count` blocks of them, `src_stride`/`dst_stride` apart, when strided), delivering
    `imm` (None: no immediate) once landed. `lane` picks one of the source's paths (a NIC,
    a stream); transports with a single path ignore it. `prepare` ignores `imm`: each
    post gives the immediates."""

    src: LocalRegion
    src_offset: int
    dst: RegionDescriptor
    dst_offset: int
    length: int
    imm: int | None
    lane: int = 0
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0


class Prepared:
    """Writes checked and resolved once (`Transport.prepare`), then posted any number of
    times with new immediates (`Transport.post`): a bucket's writes, every version.
    Transports that resolve nothing up front use it as it is."""

    __slots__ = ("requests",)

    def __init__(self, requests: Sequence[WriteRequest]) -> None:
        self.requests = tuple(requests)


@runtime_checkable
class SlotFencing(Protocol):
    """A transport that can tell when a post's reads of its source are all queued on the
    GPU, fenced by interprocess events a rank's stream can wait on (the cuda transport)."""

    async def post_fenced(
        self,
        prepared: Prepared,
        imms: Sequence[int | None],
        slot: Hashable,
        on_issued: Callable[[tuple[bytes, ...]], None],
    ) -> list[BaseException | None]: ...


@dataclass(frozen=True, slots=True)
class Gate:
    """A post's copies from `device` wait on the GPU (cuStreamWaitValue32, GEQ, cyclic)
    until the 32-bit word at `address` (of this process, on `device`) reaches `value`: the
    rank's packing of what they read is done (`BeginVersion.gate_offset`)."""

    device: int
    address: int
    value: int


@runtime_checkable
class GpuGating(Protocol):
    """A transport whose copies can wait on the GPU for a rank's pack counter (cuda)."""

    async def post_gated(
        self,
        prepared: Prepared,
        imms: Sequence[int | None],
        gate: Gate,
        fencing: tuple[Hashable, Callable[[tuple[bytes, ...]], None]] | None = None,
    ) -> list[BaseException | None]: ...


@runtime_checkable
class CudaEvents(Protocol):
    """A fencing transport whose events this process can wait on directly (the cuda
    transport: a ring slot's counter is written on the GPU after them)."""

    def events_of(self, handles: Sequence[bytes]) -> list[int] | None: ...


class Transport(abc.ABC):
    """One data-plane engine of a node. See the module docstring for the contract."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def start(self, on_imm: ImmHandler) -> None:
        """Open listeners/devices. `on_imm` receives immediates of writes that landed here."""

    @abc.abstractmethod
    def endpoints(self) -> TransportEndpoints:
        """This node's endpoint(s) for this transport, to advertise to peers."""

    @abc.abstractmethod
    def can_reach(self, endpoints: TransportEndpoints) -> bool:
        """Whether this transport can write to a node that advertised `endpoints`."""

    def accepts(self, src: LocalRegion, dst: RegionDescriptor) -> bool:
        """Whether this transport can carry a write from `src` into `dst` (kinds, keys)."""
        return True

    @abc.abstractmethod
    def register(self, region: LocalRegion) -> RegionKeys:
        """Make a region reachable (once, when it appears); returns the keys peers need."""

    @abc.abstractmethod
    def deregister(self, region_id: int) -> None:
        """Stop accepting writes to the region and release what registration held."""

    def drained(self, region_id: int, timeout_s: float) -> bool:
        """After `deregister`: whether no write this transport began into the region may
        still be landing, waiting up to `timeout_s` for it (0: answer at once, as on the
        loop). The owner unmaps the region's memory only then. Transports whose writes are
        done when they are refused or acknowledged say True (the default); cuda counts the
        copies its lanes issued into the region and waits for their events; tcp counts the
        writes its receive streams copy into a GPU region through their bounce."""
        return True

    def peer_regions(self, regions: Collection[RegionDescriptor]) -> None:  # noqa: B027
        """The regions of other nodes that this daemon's installed plans name now (called
        whenever they change): a transport that maps another node's memory by its keys
        (cuda, by CUDA IPC handle) lets go of the regions named no more. Optional hook."""

    def authorize(  # noqa: B027 - optional hook
        self, region_id: int, writers: frozenset[str], scope: str = ""
    ) -> None:
        """Receive side: only `writers` (node names) may write into the region from now on,
        with the region's key for plan `scope`. Transports whose peers are authenticated per
        connection (tcp) enforce it and start every region with no writers; verbs and cuda
        rely on a trusted fabric or host and ignore it (see README, "Trust model")."""

    @abc.abstractmethod
    async def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        """Bring up the data path to `node` (idempotent). Raises PeerLostError if unreachable."""

    @abc.abstractmethod
    async def disconnect(self, node: str, reason: str) -> None:
        """Drop the data path to `node`; its in-flight writes fail with PeerLostError."""

    @abc.abstractmethod
    async def fence(self, node: str, reason: str) -> None:
        """Receive side: stop `node`'s writes landing here (see the module docstring); it
        returns only once none of the paths `node` had can write any more (incoming
        connections closed and their receivers finished, queue pairs in error, lanes
        drained), bounded in time. Writes this node sends to `node` are not affected."""

    def set_admission(self, admit: Admit) -> None:  # noqa: B027 - optional hook
        """Give receivers that see a write's immediate before its bytes a check to refuse
        writes of failed versions with (one-sided transports rely on `fence` alone)."""

    @abc.abstractmethod
    def prepare(self, requests: Sequence[WriteRequest]) -> Prepared:
        """Check and resolve writes once, for `post`; their `imm`s are ignored. A request
        that cannot be written is not refused here: each post reports it."""

    @abc.abstractmethod
    async def post(
        self, prepared: Prepared, imms: Sequence[int | None]
    ) -> list[BaseException | None]:
        """Issue prepared writes with `imms[i]` as the immediate of write i (ValueError if
        the counts differ); resolves once every one has finished, with None or the error
        of each, in order (see the module docstring). A change since `prepare` (a region
        or peer gone, or back) is the transport's to notice."""

    @final
    async def write(self, request: WriteRequest) -> None:
        """One write, prepared and posted at once with `request.imm`; raises its error.
        The only convenience over the core: no transport overrides it."""
        (err,) = await self.post(self.prepare((request,)), (request.imm,))
        if err is not None:
            raise err

    def deliver_written(self, node: str, imms: Sequence[int]) -> bool:
        """Deliver to `node` the immediates of writes whose bytes a source rank put there
        itself (colocated: it packed straight into the destination's memory, and they are
        visible), the way this transport delivers its own writes' immediates. False where
        it cannot: the caller fails those writes."""
        return False

    @abc.abstractmethod
    async def close(self) -> None:
        """Fail everything in flight, stop threads, release resources. Bounded in time."""

    def set_signal(self, signal: Signal) -> None:  # noqa: B027 - optional hook
        """Give the transport a channel to its peers (only transports that need one use it)."""

    async def on_signal(self, node: str, payload: bytes) -> bytes:
        """Handle a bring-up message from `node`'s instance of this transport."""
        raise NotImplementedError(f"transport {self.name} takes no signals")

    def lanes(self, device_uuid: str) -> int:
        """Independent paths this transport has for memory of that GPU ("" = host memory)."""
        return 1

    def stats(self) -> dict[str, int]:
        return {}


def check_destination(dst: RegionDescriptor, dst_offset: int, length: int) -> None:
    """The writer-side check of a write against what the destination advertised."""
    if dst_offset < 0 or length < 0 or dst_offset + length > dst.length:
        raise RegionError(
            f"write [{dst_offset}, {dst_offset + length}) is outside region {dst.id} of node "
            f"{dst.node} ({dst.length} bytes)",
            code=ErrorCode.OUT_OF_BOUNDS,
        )


def check_write(r: WriteRequest) -> None:
    """The writer-side checks of a (strided) write: well-formed blocks, every source byte
    inside `src` and every destination byte inside what `dst` advertised."""
    try:
        check_blocks(r.length, r.count, r.src_stride, r.dst_stride)
    except ValueError as exc:
        raise RegionError(str(exc), code=ErrorCode.INVALID) from None
    r.src.check(r.src_offset, span(r.length, r.count, r.src_stride), "source")
    check_destination(r.dst, r.dst_offset, span(r.length, r.count, r.dst_stride))


WriteOne = Callable[[WriteRequest, int | None], Awaitable[None]]
"""`write_one(request, imm)`: one write of a transport that resolves nothing up front."""


async def post_each(
    write_one: WriteOne, prepared: Prepared, imms: Sequence[int | None]
) -> list[BaseException | None]:
    """`Transport.post` for transports that resolve nothing up front (tcp, verbs): every
    write checked and issued by `write_one` with its immediate, all at once."""
    pairs = list(zip(prepared.requests, imms, strict=True))  # ValueError: counts differ
    if len(pairs) == 1:  # `write`: no task for one write
        try:
            await write_one(*pairs[0])
        except Exception as exc:
            return [exc]
        return [None]
    outcomes = await asyncio.gather(
        *(write_one(r, imm) for r, imm in pairs), return_exceptions=True
    )
    return [o if isinstance(o, BaseException) else None for o in outcomes]
