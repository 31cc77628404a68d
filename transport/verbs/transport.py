"""The verbs transport: one-sided RDMA WRITEs from registered memory into a peer's
registered memory, over RC queue pairs, with WRITE_WITH_IMM carrying the immediate.

Outline (see the README's "RDMA (verbs)" section for the knobs):

- Each configured device is opened once: one protection domain, one completion queue with
  its completion channel, watched by the event loop (`add_reader` on the channel's fd), or
  polled by a thread of the transport's own where the fd cannot be had.
- A region is registered once per NIC of its lane set (a GPU's affine NICs, or the host
  NICs); its keys (device, address, rkey) go to peers inside the region descriptor.
- A writer owns "links": per (local device, remote device) pair, `qps_per_peer` RC queue
  pairs, brought up through the daemons' authenticated mesh (`Connect`: QPN, PSN, GID,
  MTU both ways). The destination keeps `recv_depth` receives posted on each incoming QP.
- `write` checks the descriptor with the owner once (`Check`: unknown region, wrong key,
  length beyond the real region are refused with their own codes), then queues the write
  on the least busy QP of the lane's link. A write is cut into WRs of at most the chunk
  size, posted in chains of `wr_per_post`; only the last WR (and one every half send
  queue) is signaled, and the send-queue slots of unsignaled WRs are counted here (real
  NICs free them only when a later signaled WR completes). The last WR is
  WRITE_WITH_IMM when there is an immediate. The write resolves on its last WR's send
  completion: RC ordering puts every earlier WR of the QP in place before that.
- The destination delivers the immediate on its RECV_RDMA_WITH_IMM completion, which
  comes only after the bytes are visible, and reposts the receive.
- An error completion fails every write in flight on that QP with a TransferError naming
  the peer; the QP pair is rebuilt (RESET -> INIT -> RTR -> RTS, new PSNs, receives
  re-posted) through the mesh, and later writes use it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import itertools
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
import structlog

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    RegionError,
    RegistrationError,
    TransferError,
    WeightwireError,
    error_from_code,
)
from weightwire.protocol.regions import (
    RegionDescriptor,
    RegionKeys,
    TransportEndpoints,
    VerbsEndpoint,
    VerbsKey,
)
from weightwire.transport.base import (
    ImmHandler,
    LocalRegion,
    Signal,
    Transport,
    check_destination,
)

from . import wire
from .devices import (
    DeviceInfo,
    affine_nics,
    discover,
    pci_path_of_bus_id,
    pci_path_of_nic,
)
from .hw import OpenDevice
from .ibv import Api, errno_of, load

log = structlog.get_logger("weightwire.transport.verbs")

T = TypeVar("T")
Completions = Literal["auto", "channel", "thread"]

READY, BROKEN, DEAD = "ready", "broken", "dead"
ID_BITS = 40  # wr_id = generation << 40 | write id
ID_MASK = (1 << ID_BITS) - 1
FAULT_ENV = "WEIGHTWIRE_VERBS_FAULT_FILE"  # tests only: see _fault()
MAX_INCOMING_QPS_PER_NODE = 1024


def _psn() -> int:
    return secrets.randbits(24)


def address_of(view: memoryview) -> int:
    """The address of a writable buffer (the temporary ctypes export ends at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass(eq=False)
class _Write:
    id: int
    future: asyncio.Future[None]
    peer: str
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int
    imm: int | None
    wrs_left: int
    offset: int = 0  # bytes posted so far


@dataclass(eq=False)
class _Qp:
    """One outgoing RC queue pair of a link, with its send-queue accounting."""

    link: _Link
    index: int
    qp: Any
    qpn: int
    psn: int
    depth: int  # max_send_wr
    wrs: list[Any]  # wr_per_post SendWRs chained once: a post of k uses the last k
    sges: list[Any]
    state: str = READY
    gen: int = 1
    used: int = 0  # send-queue slots held (posted, not yet freed by a signaled completion)
    run: int = 0  # WRs posted since the last signaled one
    credits: int = 0  # WRITE_WITH_IMMs the peer has receives for
    recv_depth: int = 0
    signaled: deque[tuple[int, int, _Write | None]] = field(default_factory=deque)
    queue: deque[_Write] = field(default_factory=deque)
    inflight: dict[int, _Write] = field(default_factory=dict)
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def dev(self) -> OpenDevice:
        return self.link.dev

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.inflight)


@dataclass(eq=False)
class _Link:
    """Outgoing queue pairs from one local device to one device of a peer."""

    id: int
    peer: str
    dev: OpenDevice
    dst_device: str
    up: asyncio.Future[None]
    chunk: int = 0
    remote: wire.Path | None = None
    qps: list[_Qp] = field(default_factory=list)
    dead: str = ""

    def pick(self) -> _Qp:
        ready = [q for q in self.qps if q.state == READY] or self.qps
        return min(ready, key=lambda q: q.load)


@dataclass(eq=False)
class _InQp:
    """One incoming RC queue pair: receives kept posted for WRITE_WITH_IMM."""

    node: str
    link: int
    index: int
    dev: OpenDevice
    qp: Any
    qpn: int
    psn: int
    recv: Any  # one RecvWR, reposted
    depth: int  # receives kept posted
    state: str = READY
    gen: int = 1


@dataclass(eq=False)
class _InLink:
    node: str
    id: int
    src: wire.Path
    qps: list[_InQp] = field(default_factory=list)


@dataclass(eq=False)
class _Peer:
    node: str
    endpoints: TransportEndpoints
    links: dict[tuple[str, str], _Link] = field(default_factory=dict)
    valid: set[tuple[int, str, int, int, int]] = field(default_factory=set)
    checking: dict[tuple[int, str, int, int, int], asyncio.Task[None]] = field(default_factory=dict)


@dataclass(eq=False)
class _Registered:
    region: LocalRegion
    devices: list[str]  # its lanes, in order
    mrs: dict[str, Any]
    base: int  # the address of byte 0 in the MRs' address space (virtual, or dma-buf offset)
    keys: dict[str, VerbsKey]
    dmabuf_fd: int | None = None  # exported here, closed at deregistration


class VerbsTransport(Transport):
    name: ClassVar[str] = "verbs"

    def __init__(
        self,
        node: str,
        *,
        devices: Iterable[str] = (),
        gid_index: int = -1,
        chunk_bytes: int = 8 << 20,
        wr_per_post: int = 4,
        qps_per_peer: int = 1,
        send_depth: int = 512,
        recv_depth: int = 128,
        nics_per_gpu: int = 0,
        host_nics: int = 1,
        relaxed_ordering: bool = True,
        completions: Completions = "auto",
        stall_timeout_s: float = 30.0,
        signal_timeout_s: float = 15.0,
        sysfs: str = "/sys",
    ) -> None:
        if chunk_bytes < 1 or wr_per_post < 1 or qps_per_peer < 1 or recv_depth < 1:
            raise TransferError(
                "verbs_chunk_bytes, verbs_wr_per_post, verbs_qps_per_peer and "
                "verbs_recv_depth must be positive",
                code=ErrorCode.INVALID,
            )
        self.node = node
        self.api: Api = load()
        self.E = self.api.E
        self.infos: list[DeviceInfo] = discover(devices, gid_index, self.api)
        self.chunk_bytes = chunk_bytes
        self.wr_per_post = wr_per_post
        self.qps_per_peer = qps_per_peer
        self.send_depth = max(send_depth, 2 * wr_per_post, 4)
        self.recv_depth = recv_depth
        self.nics_per_gpu = nics_per_gpu
        self.host_nics = host_nics
        self.relaxed_ordering = relaxed_ordering
        self.completions = completions
        self.stall_timeout_s = stall_timeout_s
        self.signal_timeout_s = signal_timeout_s
        self.sysfs = sysfs
        self._devs: dict[str, OpenDevice] = {}
        self._order = [i.name for i in self.infos]
        self._qps: dict[tuple[str, int], _Qp | _InQp] = {}
        self._regions: dict[int, _Registered] = {}
        self._peers: dict[str, _Peer] = {}
        self._inlinks: dict[tuple[str, int], _InLink] = {}
        self._gpu_nics: dict[str, list[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_imm: ImmHandler | None = None
        self._signal: Signal | None = None
        self._ids = itertools.count(1)
        self._link_ids = itertools.count(secrets.randbits(40) << 16)
        self._lock = threading.Lock()
        self._busy = 0  # verbs calls running on worker threads (close waits for them)
        self._qp_ops = 0  # of those, the ones that may touch queue pairs (counted on the loop)
        self._graveyard: list[Any] = []  # QPs to destroy once _qp_ops is 0
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._readers: list[int] = []
        self._fault_file = os.environ.get(FAULT_ENV, "")
        self._stats = {
            "bytes_sent": 0,
            "writes": 0,
            "wrs_posted": 0,
            "posts": 0,
            "imms_received": 0,
            "write_errors": 0,
            "error_completions": 0,
            "qp_rebuilds": 0,
            "links": 0,
            "incoming_qps": 0,
            "max_sq_used": 0,
            "checks": 0,
            "regions": 0,
        }

    # --- lifecycle -----------------------------------------------------------

    async def start(self, on_imm: ImmHandler) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_imm = on_imm
        want_channel = self.completions in ("auto", "channel")
        for info in self.infos:
            dev = await self._thread(
                functools.partial(OpenDevice, self.api, info, channel=want_channel)
            )
            self._devs[info.name] = dev
            if dev.fd is None and self.completions == "channel":
                raise TransferError(f"{info.name}: no completion channel fd to wait on")
        polled = [d for d in self._devs.values() if d.fd is None]
        for dev in self._devs.values():
            if dev.fd is not None:
                dev.cq.req_notify()
                self._loop.add_reader(dev.fd, self._readable, dev)
                self._readers.append(dev.fd)
                self._drain(dev)  # a completion that came before arming gives no event
        if polled:
            self._poller = threading.Thread(
                target=self._poll_thread, args=(polled,), name="verbs-poll", daemon=True
            )
            self._poller.start()
        self._spawn(self._watchdog())
        log.info(
            "verbs transport up",
            devices=[d.info.describe() for d in self._devs.values()],
            completions="thread" if polled else "channel",
            pyverbs=self.api.version,
        )

    def set_signal(self, signal: Signal) -> None:
        self._signal = signal

    def endpoints(self) -> TransportEndpoints:
        return TransportEndpoints(
            verbs=VerbsEndpoint(devices=tuple(self._order), gids=tuple(i.gid for i in self.infos))
        )

    def can_reach(self, endpoints: TransportEndpoints) -> bool:
        return endpoints.verbs is not None and bool(endpoints.verbs.devices)

    def accepts(self, src: LocalRegion, dst: RegionDescriptor) -> bool:
        return bool(dst.keys.verbs) and src.id in self._regions

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "the verbs transport is closing", notify=False)
        self._peers.clear()
        for key in list(self._inlinks):
            self._drop_in(key[0], key[1])
        if self._loop is not None:
            for fd in self._readers:
                self._loop.remove_reader(fd)
        self._readers.clear()
        self._stop.set()
        deadline = time.monotonic() + 5.0
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._poller is not None:
            await asyncio.to_thread(self._poller.join, 5.0)
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for reg in regions:
            self._release(reg)
        self._qp_ops = 0  # waited for above (bounded): everything left goes now
        self._retire([])
        for dev in self._devs.values():
            dev.close()
        self._devs.clear()
        self._qps.clear()

    # --- threads -------------------------------------------------------------

    async def _thread(self, fn: Callable[[], T]) -> T:
        """A blocking verbs call on a worker thread (close() waits for those running)."""
        with self._lock:
            self._busy += 1
        self._qp_ops += 1
        try:
            return await asyncio.to_thread(fn)
        finally:
            with self._lock:
                self._busy -= 1
            self._qp_ops -= 1
            if not self._qp_ops and self._graveyard:
                self._retire([])

    def _retire(self, objs: list[Any]) -> None:
        """Destroy queue pairs (and their WR parts) once no worker thread may be modifying
        one of them: destroying a QP under a running ibv_modify_qp is undefined."""
        self._graveyard.extend(objs)
        if self._qp_ops:
            return
        dead, self._graveyard = self._graveyard, []
        for obj in dead:
            with contextlib.suppress(Exception):
                obj.close()

    def _spawn(self, coro: Any) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- regions ---------------------------------------------------------------

    def _host_devices(self) -> list[str]:
        n = self.host_nics if self.host_nics > 0 else len(self._order)
        return self._order[: max(1, min(n, len(self._order)))]

    def _gpu_devices(self, uuid: str) -> list[str]:
        cached = self._gpu_nics.get(uuid)
        if cached is not None:
            return cached
        try:
            from weightwire.transport.cudadrv import driver

            drv = driver()
            gpu_path = pci_path_of_bus_id(drv.pci_bus_id(drv.ordinal_of(uuid)), self.sysfs)
            nics = affine_nics(gpu_path, {n: pci_path_of_nic(n, self.sysfs) for n in self._order})
        except (WeightwireError, OSError, ValueError, AttributeError) as exc:
            log.warning("no PCIe affinity for a GPU: using the host NICs", gpu=uuid, error=str(exc))
            nics = self._host_devices()
        if self.nics_per_gpu > 0:
            nics = nics[: self.nics_per_gpu]
        self._gpu_nics[uuid] = nics
        log.info("NICs of a GPU", gpu=uuid, nics=nics)
        return nics

    def lanes(self, device_uuid: str) -> int:
        if not device_uuid:
            return len(self._host_devices())
        return len(self._gpu_devices(device_uuid))

    def _lane_devices(self, region: LocalRegion) -> list[str]:
        uuid = region.extra.get("device_uuid")
        if region.kind == "gpu" and isinstance(uuid, str) and uuid:
            return self._gpu_devices(uuid)
        return self._host_devices()

    def register(self, region: LocalRegion) -> RegionKeys:
        """Pin the region on each NIC of its lanes (on a worker thread in the daemon)."""
        if not self._devs or self._closed:
            raise RegistrationError("the verbs transport is not running")
        devices = self._lane_devices(region)
        owned_fd: int | None = None
        fd = -1
        if region.kind == "cpu":
            if region.address:
                base = region.address
            elif region.view is not None:
                base = address_of(region.view)
            else:
                raise RegistrationError(f"region {region.id} has no host address for verbs")
        else:
            try:
                fd, base, owned_fd = self._dmabuf(region)
            except (WeightwireError, OSError) as exc:
                log.warning(
                    "GPU region not registered with verbs (no dma-buf): another transport "
                    "carries it",
                    region=region.id,
                    error=str(exc),
                )
                return RegionKeys()
        mrs: dict[str, Any] = {}
        with self._lock:
            self._busy += 1
        try:
            for name in devices:
                dev = self._devs[name]
                if region.kind == "cpu":
                    mrs[name] = dev.register(base, region.length, self.relaxed_ordering)
                else:
                    mrs[name] = dev.register_dmabuf(fd, base, region.length, self.relaxed_ordering)
        except self.api.Error as exc:
            for mr in mrs.values():
                with contextlib.suppress(Exception):
                    mr.close()
            if owned_fd is not None:
                os.close(owned_fd)
            hint = ""
            if errno_of(exc) in (errno.ENOMEM, errno.EPERM, -1):
                hint = " (pinning needs CAP_IPC_LOCK or a large `ulimit -l`: LimitMEMLOCK)"
            raise RegistrationError(
                f"cannot register region {region.id} ({region.length} bytes) with "
                f"{', '.join(devices)}: {exc}{hint}"
            ) from None
        finally:
            with self._lock:
                self._busy -= 1
        keys = {
            name: VerbsKey(device=name, addr=base, rkey=int(mr.rkey)) for name, mr in mrs.items()
        }
        reg = _Registered(region, devices, mrs, base, keys, owned_fd)
        with self._lock:
            old = self._regions.pop(region.id, None)
            self._regions[region.id] = reg
            self._stats["regions"] = len(self._regions)
        if old is not None:
            self._release(old)
        return RegionKeys(verbs=tuple(keys[n] for n in devices))

    def _dmabuf(self, region: LocalRegion) -> tuple[int, int, int | None]:
        """(fd, offset of byte 0 in it, fd to close later) for GPU memory: the dma-buf the
        rank handed over, or one exported here through the CUDA driver."""
        if region.fd is not None:
            offset = region.extra.get("dmabuf_offset", 0)
            return region.fd, int(offset) if isinstance(offset, int) else 0, None
        from weightwire.transport.cudadrv import driver

        drv = driver()
        if region.device is not None:
            drv.use(region.device)
        page = os.sysconf("SC_PAGE_SIZE")
        start = region.address & ~(page - 1)
        end = -(-(region.address + region.length) // page) * page
        fd = drv.dma_buf_fd(start, end - start)
        return fd, region.address - start, fd

    def deregister(self, region_id: int) -> None:
        with self._lock:
            reg = self._regions.pop(region_id, None)
            self._stats["regions"] = len(self._regions)
        if reg is not None:
            self._release(reg)

    def _release(self, reg: _Registered) -> None:
        for mr in reg.mrs.values():
            with contextlib.suppress(Exception):
                mr.close()
        if reg.dmabuf_fd is not None:
            with contextlib.suppress(OSError):
                os.close(reg.dmabuf_fd)

    # --- peers -----------------------------------------------------------------

    async def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        if self._closed:
            raise PeerLostError("the verbs transport is closed")
        if endpoints.verbs is None or not endpoints.verbs.devices:
            raise PeerLostError(f"node {node} has no verbs endpoint")
        peer = self._peers.get(node)
        if peer is None:
            self._peers[node] = _Peer(node, endpoints)
        else:
            peer.endpoints = endpoints

    async def disconnect(self, node: str, reason: str) -> None:
        peer = self._peers.pop(node, None)
        if peer is not None:
            self._drop_peer(peer, reason, notify=True)
        for key in [k for k in self._inlinks if k[0] == node]:
            self._drop_in(*key)

    def _drop_peer(self, peer: _Peer, reason: str, *, notify: bool) -> None:
        for link in list(peer.links.values()):
            self._kill_link(link, f"{peer.node}: {reason}", notify=notify)
        peer.links.clear()
        peer.valid.clear()  # checks still running end by their own timeout

    def _kill_link(self, link: _Link, reason: str, *, notify: bool) -> None:
        """Fail everything on the link, destroy its QPs, forget it (and tell the peer)."""
        if link.dead:
            return
        link.dead = reason
        if not link.up.done():
            link.up.set_exception(PeerLostError(reason))
            link.up.exception()  # retrieved: waiters get it through their own await
        peer = self._peers.get(link.peer)
        if peer is not None and peer.links.get((link.dev.name, link.dst_device)) is link:
            del peer.links[(link.dev.name, link.dst_device)]
        for q in link.qps:
            self._fail_writes(q, lambda w: PeerLostError(reason))
            q.state = DEAD
            self._qps.pop((link.dev.name, q.qpn), None)
            self._retire([q.qp, *q.sges])
            link.dev.release_cq(q.depth + 1)
        self._stats["links"] = sum(len(p.links) for p in self._peers.values())
        if notify and not self._closed:
            self._spawn(self._tell_close(link.peer, link.id))

    async def _tell_close(self, node: str, link: int) -> None:
        with contextlib.suppress(WeightwireError):
            await self._ask(node, wire.Close(link=link))

    # --- signals -----------------------------------------------------------------

    async def _ask(self, node: str, msg: wire.Request) -> wire.Reply:
        """One bring-up request to `node`'s verbs transport, with a timeout; refusals
        become the TransferError subclass of their code."""
        payload = wire.encode(msg)
        try:
            if node == self.node:
                data = await self.on_signal(self.node, payload)
            elif self._signal is None:
                raise PeerLostError(f"no signal channel to {node} (set_signal was not called)")
            else:
                data = await asyncio.wait_for(self._signal(node, payload), self.signal_timeout_s)
        except TimeoutError:
            raise PeerLostError(
                f"{node} did not answer a verbs {type(msg).__name__.lower()} in "
                f"{self.signal_timeout_s:.0f} s"
            ) from None
        except PeerLostError:
            raise
        except WeightwireError as exc:
            raise PeerLostError(f"{node}: {exc.message}") from None
        except (OSError, RuntimeError) as exc:
            raise PeerLostError(f"{node}: {exc}") from None
        try:
            reply = wire.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"{node} answered a verbs request with garbage: {exc}") from None
        if isinstance(reply, wire.Refused):
            err = error_from_code(reply.code, f"{node}: {reply.message}")
            if not isinstance(err, TransferError):
                err = TransferError(err.message, code=err.code)
            raise err
        return reply

    async def on_signal(self, node: str, payload: bytes) -> bytes:
        """Requests from writers on other nodes. Always answers (refusals carry a code)."""
        try:
            req = wire.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return wire.encode(wire.Refused(code=ErrorCode.MALFORMED.value, message=str(exc)))
        if self._closed or not self._devs:
            return wire.encode(
                wire.Refused(
                    code=ErrorCode.PEER_LOST.value,
                    message=f"the verbs transport of {self.node} is not running",
                )
            )
        try:
            reply: wire.Reply
            match req:
                case wire.Check():
                    reply = self._check(req)
                case wire.Connect():
                    reply = await self._accept_connect(node, req)
                case wire.Reset():
                    reply = await self._accept_reset(node, req)
                case wire.Close(link=link):
                    if link is None:
                        for key in [k for k in self._inlinks if k[0] == node]:
                            self._drop_in(*key)
                    else:
                        self._drop_in(node, link)
                    reply = wire.Accepted()
        except WeightwireError as exc:
            reply = wire.Refused(code=exc.code.value, message=exc.message)
        except self.api.Error as exc:
            reply = wire.Refused(code=ErrorCode.TRANSFER.value, message=f"{self.node}: {exc}")
        return wire.encode(reply)

    def _check(self, req: wire.Check) -> wire.Reply:
        self._stats["checks"] += 1
        reg = self._regions.get(req.region)
        if reg is None:
            raise RegionError(f"no region {req.region} here", code=ErrorCode.UNKNOWN_REGION)
        key = reg.keys.get(req.device)
        if key is None or key.addr != req.addr or key.rkey != req.rkey:
            raise RegionError(f"wrong key for region {req.region}", code=ErrorCode.UNAUTHORIZED)
        if req.length > reg.region.length:
            raise RegionError(
                f"region {req.region} has {reg.region.length} bytes, not {req.length}",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        return wire.Checked()

    # --- incoming queue pairs (this node is the destination) ---------------------------

    async def _accept_connect(self, node: str, req: wire.Connect) -> wire.Reply:
        dev = self._devs.get(req.dst_device)
        if dev is None:
            raise TransferError(
                f"{self.node} has no RDMA device {req.dst_device} (has {', '.join(self._order)})",
                code=ErrorCode.INVALID,
            )
        if not req.qps or len(req.qps) > 64:
            raise TransferError("a link has 1 to 64 queue pairs", code=ErrorCode.INVALID)
        mine = sum(len(il.qps) for (n, _), il in self._inlinks.items() if n == node)
        if mine + len(req.qps) > MAX_INCOMING_QPS_PER_NODE:
            raise TransferError(f"{node} has too many queue pairs here", code=ErrorCode.INVALID)
        self._drop_in(node, req.link)
        inl = _InLink(node=node, id=req.link, src=req.src)
        depth = min(self.recv_depth, dev.info.max_qp_wr)

        def build() -> list[_InQp]:
            made: list[_InQp] = []
            try:
                for i, info in enumerate(req.qps):
                    dev.reserve_cq(depth + 1)
                    try:
                        qp = dev.create_qp(1, depth)
                    except BaseException:
                        dev.release_cq(depth + 1)
                        raise
                    sge = self.api.SGE(dev.scratch.buf, 64, dev.scratch.lkey)
                    recv = self.api.RecvWR(wr_id=0, num_sge=1, sg=[sge])
                    sge.close()  # RecvWR copied it
                    r = _InQp(node, req.link, i, dev, qp, int(qp.qp_num), _psn(), recv, depth)
                    made.append(r)
                    self._bring_in_up(r, inl.src, info)
            except BaseException:
                for r in made:
                    with contextlib.suppress(Exception):
                        r.qp.close()
                    dev.release_cq(depth + 1)
                raise
            return made

        inl.qps = await self._thread(build)
        if self._closed:
            self._retire([r.qp for r in inl.qps])
            raise PeerLostError("closing")
        self._inlinks[(node, req.link)] = inl
        for r in inl.qps:
            self._qps[(dev.name, r.qpn)] = r
        self._stats["incoming_qps"] = sum(len(x.qps) for x in self._inlinks.values())
        log.debug("incoming link up", peer=node, device=dev.name, qps=len(inl.qps))
        return wire.Accepted(
            path=self._path(dev),
            qps=tuple(wire.QpInfo(r.qpn, r.psn) for r in inl.qps),
            recv_depth=depth,
        )

    def _bring_in_up(self, r: _InQp, src: wire.Path, peer_qp: wire.QpInfo) -> None:
        """INIT, receives posted, RTR (towards the writer's QP), RTS. Worker thread."""
        r.dev.to_init(r.qp)
        for i in range(r.depth):
            r.recv.wr_id = (r.gen << ID_BITS) | i
            r.qp.post_recv(r.recv)
        r.dev.to_rtr(r.qp, src, peer_qp.qpn, peer_qp.psn)
        r.dev.to_rts(r.qp, r.psn)

    async def _accept_reset(self, node: str, req: wire.Reset) -> wire.Reply:
        inl = self._inlinks.get((node, req.link))
        if inl is None or not 0 <= req.index < len(inl.qps):
            raise PeerLostError(f"{self.node} has no such link from {node} (it was dropped)")
        r = inl.qps[req.index]
        r.state = BROKEN
        r.gen += 1
        r.psn = _psn()

        def rebuild() -> None:
            r.dev.to_reset(r.qp)
            self._bring_in_up(r, inl.src, req.qp)

        await self._thread(rebuild)
        r.state = READY
        return wire.Accepted(
            path=self._path(r.dev), qps=(wire.QpInfo(r.qpn, r.psn),), recv_depth=r.depth
        )

    def _drop_in(self, node: str, link: int) -> None:
        inl = self._inlinks.pop((node, link), None)
        if inl is None:
            return
        for r in inl.qps:
            r.state = DEAD
            self._qps.pop((r.dev.name, r.qpn), None)
            self._retire([r.qp, r.recv])
            r.dev.release_cq(r.depth + 1)
        self._stats["incoming_qps"] = sum(len(x.qps) for x in self._inlinks.values())

    def _path(self, dev: OpenDevice) -> wire.Path:
        p = dev.path()
        return msgspec.structs.replace(p, max_msg=dev.info.max_msg_sz)

    # --- outgoing links (this node writes) -----------------------------------------

    async def _link(self, peer: _Peer, sdev: str, ddev: str) -> _Link:
        link = peer.links.get((sdev, ddev))
        if link is not None:
            await asyncio.shield(link.up)
            return link
        assert self._loop is not None
        dev = self._devs[sdev]
        link = _Link(
            id=next(self._link_ids) & ((1 << 63) - 1),
            peer=peer.node,
            dev=dev,
            dst_device=ddev,
            up=self._loop.create_future(),
        )
        peer.links[(sdev, ddev)] = link
        try:
            await self._bring_up(link)
        except BaseException as exc:
            err = (
                exc
                if isinstance(exc, TransferError)
                else PeerLostError(f"cannot reach {peer.node} over {sdev} -> {ddev}: {exc!r}")
            )
            if not link.up.done():
                link.up.set_exception(err)
                link.up.exception()  # retrieved: other waiters get it from their own await
            self._kill_link(link, err.message, notify=False)
            raise err from None
        if self._peers.get(peer.node) is not peer:  # disconnected meanwhile
            self._kill_link(link, f"{peer.node} was disconnected", notify=True)
            raise PeerLostError(f"{peer.node} was disconnected")
        link.up.set_result(None)
        self._stats["links"] = sum(len(p.links) for p in self._peers.values())
        return link

    async def _bring_up(self, link: _Link) -> None:
        dev = link.dev
        depth = max(2 * self.wr_per_post, min(self.send_depth, dev.info.max_qp_wr))

        def create() -> list[_Qp]:
            made: list[_Qp] = []
            try:
                for i in range(self.qps_per_peer):
                    dev.reserve_cq(depth + 1)
                    try:
                        qp = dev.create_qp(depth, 1)
                    except BaseException:
                        dev.release_cq(depth + 1)
                        raise
                    wrs, sges = self._chain(dev)
                    q = _Qp(link, i, qp, int(qp.qp_num), _psn(), depth, wrs, sges)
                    made.append(q)
                    dev.to_init(qp)
            except BaseException:
                for q in made:
                    with contextlib.suppress(Exception):
                        q.qp.close()
                    dev.release_cq(depth + 1)
                raise
            return made

        link.qps = await self._thread(create)
        reply = await self._ask(
            link.peer,
            wire.Connect(
                link=link.id,
                src=self._path(dev),
                dst_device=link.dst_device,
                qps=tuple(wire.QpInfo(q.qpn, q.psn) for q in link.qps),
            ),
        )
        if (
            not isinstance(reply, wire.Accepted)
            or reply.path is None
            or len(reply.qps) != len(link.qps)
        ):
            raise TransferError(f"{link.peer} answered a verbs connect with {reply}")
        remote = reply.path
        link.remote = remote
        chunk = min(self.chunk_bytes, dev.info.max_msg_sz or self.chunk_bytes)
        if remote.max_msg:
            chunk = min(chunk, remote.max_msg)
        link.chunk = max(1, chunk)

        def up() -> None:
            for q, theirs in zip(link.qps, reply.qps, strict=True):
                dev.to_rtr(q.qp, remote, theirs.qpn, theirs.psn)
                dev.to_rts(q.qp, q.psn)

        await self._thread(up)
        if link.dead or self._closed:
            raise PeerLostError(link.dead or "closing")
        for q in link.qps:
            q.recv_depth = q.credits = max(1, reply.recv_depth)
            self._qps[(dev.name, q.qpn)] = q
        log.info(
            "verbs link up",
            peer=link.peer,
            local=dev.name,
            remote=link.dst_device,
            qps=[q.qpn for q in link.qps],
            chunk=link.chunk,
        )

    def _chain(self, dev: OpenDevice) -> tuple[list[Any], list[Any]]:
        """wr_per_post SendWRs chained once (wr[i].next = wr[i+1]; the last ends the
        chain); each points at an SGE of its own that is rewritten for every post."""
        api, E = self.api, self.E
        sges, wrs = [], []
        for _ in range(self.wr_per_post):
            sge = api.SGE(dev.scratch.buf, 0, dev.scratch.lkey)
            wr = api.SendWR(wr_id=0, opcode=E.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=0)
            wr.sg_list = sge  # the WR now reads this SGE (never close the WR: see README notes)
            sges.append(sge)
            wrs.append(wr)
        for a, b in itertools.pairwise(wrs):
            a.next_wr = b
        return wrs, sges

    async def _rebuild(self, q: _Qp) -> None:
        link = q.link
        try:
            await self._thread(lambda: q.dev.to_reset(q.qp))
            q.psn = _psn()
            reply = await self._ask(
                link.peer,
                wire.Reset(link=link.id, index=q.index, qp=wire.QpInfo(q.qpn, q.psn)),
            )
            if not isinstance(reply, wire.Accepted) or len(reply.qps) != 1:
                raise TransferError(f"{link.peer} answered a reset with {reply}")
            theirs = reply.qps[0]
            remote = reply.path or link.remote
            assert remote is not None

            def up() -> None:
                q.dev.to_init(q.qp)
                q.dev.to_rtr(q.qp, remote, theirs.qpn, theirs.psn)
                q.dev.to_rts(q.qp, q.psn)

            await self._thread(up)
        except (WeightwireError, self.api.Error, OSError) as exc:
            if not link.dead:
                log.warning("queue pair not rebuilt: link dropped", peer=link.peer, error=str(exc))
                self._kill_link(
                    link, f"{link.peer}: rebuilding queue pair failed: {exc}", notify=True
                )
            return
        if link.dead or q.state == DEAD:
            return
        q.state = READY
        q.recv_depth = q.credits = max(1, reply.recv_depth)
        q.last_progress = time.monotonic()
        self._stats["qp_rebuilds"] += 1
        log.info("queue pair rebuilt", peer=link.peer, device=q.dev.name, qpn=q.qpn)
        self._pump(q)

    # --- writing -------------------------------------------------------------------

    async def write(
        self,
        src: LocalRegion,
        src_offset: int,
        dst: RegionDescriptor,
        dst_offset: int,
        length: int,
        imm: int | None,
        lane: int = 0,
    ) -> None:
        src.check(src_offset, length, "source")
        check_destination(dst, dst_offset, length)
        if not dst.keys.verbs:
            raise RegionError(f"region {dst.id} of node {dst.node} has no verbs key")
        reg = self._regions.get(src.id)
        if reg is None:
            raise RegionError(f"source region {src.id} is not registered with verbs")
        if self._closed:
            raise PeerLostError("the verbs transport is closed")
        peer = self._peers.get(dst.node)
        if peer is None:
            raise PeerLostError(f"not connected to node {dst.node}")
        sdev = reg.devices[lane % len(reg.devices)]
        key = dst.keys.verbs[lane % len(dst.keys.verbs)]
        await self._validate(peer, dst, key)
        if self._peers.get(dst.node) is not peer:
            raise PeerLostError(f"{dst.node} was disconnected")
        link = await self._link(peer, sdev, key.device)
        if self._peers.get(dst.node) is not peer or link.dead:
            raise PeerLostError(link.dead or f"{dst.node} was disconnected")
        assert self._loop is not None
        rkey = key.rkey
        if self._fault_file:
            rkey = self._fault(rkey)
        w = _Write(
            id=next(self._ids) & ID_MASK,
            future=self._loop.create_future(),
            peer=dst.node,
            local_addr=reg.base + src_offset,
            lkey=int(reg.mrs[sdev].lkey),
            remote_addr=key.addr + dst_offset,
            rkey=rkey,
            length=length,
            imm=None if imm is None else imm & 0xFFFFFFFF,
            wrs_left=max(1, -(-length // link.chunk)),
        )
        q = link.pick()
        q.queue.append(w)
        self._pump(q)
        await w.future

    async def _validate(self, peer: _Peer, dst: RegionDescriptor, key: VerbsKey) -> None:
        """Ask the destination once per descriptor whether it is real: RDMA itself only
        checks rkey and bounds, not which region a descriptor says it is."""
        ck = (dst.id, key.device, key.addr, key.rkey, dst.length)
        if ck in peer.valid:
            return
        task = peer.checking.get(ck)
        if task is None:
            assert self._loop is not None
            task = self._loop.create_task(self._check_remote(peer, ck))
            peer.checking[ck] = task
        await asyncio.shield(task)

    async def _check_remote(self, peer: _Peer, ck: tuple[int, str, int, int, int]) -> None:
        try:
            region, device, addr, rkey, length = ck
            await self._ask(
                peer.node,
                wire.Check(region=region, device=device, addr=addr, rkey=rkey, length=length),
            )
            peer.valid.add(ck)
        finally:
            peer.checking.pop(ck, None)

    def _fault(self, rkey: int) -> int:
        """Tests only (WEIGHTWIRE_VERBS_FAULT_FILE): when that file exists and says `rkey`,
        remove it and give this one write a wrong rkey, past the descriptor check, so the
        NIC refuses it with an error completion."""
        try:
            with open(self._fault_file) as f:
                what = f.read().strip()
            os.unlink(self._fault_file)
        except OSError:
            return rkey
        if what == "rkey":
            log.warning("fault injected: a write with a wrong rkey", file=self._fault_file)
            return rkey ^ 0x5A5A00
        return rkey

    def _pump(self, q: _Qp) -> None:
        """Post as much of the QP's queue as its send queue and the peer's receives allow,
        in chains of at most wr_per_post WRs."""
        E = self.E
        write_op, imm_op, signaled_flag = (
            E.IBV_WR_RDMA_WRITE,
            E.IBV_WR_RDMA_WRITE_WITH_IMM,
            E.IBV_SEND_SIGNALED,
        )
        every = max(1, q.depth // 2)
        chunk = q.link.chunk
        per = len(q.wrs)
        while q.state == READY and q.queue:
            w = q.queue[0]
            k = min(per, w.wrs_left)
            if q.used + k > q.depth:
                break
            ends = k == w.wrs_left
            if ends and w.imm is not None and q.credits <= 0:
                if k == 1:
                    break
                k -= 1
                ends = False
            first = per - k
            entries: list[tuple[int, int, _Write | None]] = []
            offset = w.offset
            for j in range(k):
                wr, sge = q.wrs[first + j], q.sges[first + j]
                n = min(chunk, w.length - offset)
                sge.addr = w.local_addr + offset
                sge.length = n
                sge.lkey = w.lkey
                wr.set_wr_rdma(w.rkey, w.remote_addr + offset)
                final = ends and j == k - 1
                wr_id = (q.gen << ID_BITS) | w.id
                wr.wr_id = wr_id
                if final and w.imm is not None:
                    wr.opcode = imm_op
                    wr.imm_data = socket.htonl(w.imm)  # a __be32 field, stored untouched
                else:
                    wr.opcode = write_op
                q.run += 1
                if final or q.run >= every:
                    wr.send_flags = signaled_flag
                    entries.append((wr_id, q.run, w if final else None))
                    q.run = 0
                else:
                    wr.send_flags = 0
                offset += n
            try:
                q.qp.post_send(q.wrs[first])
            except self.api.Error as exc:
                q.run = 0
                self._qp_failed(q, None, w.id, f"post_send failed: {exc}")
                return
            if not q.used:
                q.last_progress = time.monotonic()
            q.used += k
            q.signaled.extend(entries)
            w.offset = offset
            w.wrs_left -= k
            q.inflight[w.id] = w
            if ends:
                q.queue.popleft()
                if w.imm is not None:
                    q.credits -= 1
            st = self._stats
            st["wrs_posted"] += k
            st["posts"] += 1
            if q.used > st["max_sq_used"]:
                st["max_sq_used"] = q.used

    # --- completions -----------------------------------------------------------------

    def _readable(self, dev: OpenDevice) -> None:
        try:
            dev.channel.get_cq_event(dev.cq)
        except self.api.Error:
            pass  # nothing queued (EAGAIN): poll anyway
        else:
            dev.cq.ack_events(1)
        dev.cq.req_notify()  # re-arm before polling: a CQE after the poll fires again
        self._drain(dev)

    def _drain(self, dev: OpenDevice, budget: int = 4096) -> None:
        if self._closed:
            return
        while budget > 0:
            n, wcs = dev.cq.poll(64)
            if n:
                self._handle(dev, wcs)
                budget -= n
            if n < 64:
                return
        assert self._loop is not None
        self._loop.call_soon(self._drain, dev)  # let others run; more are waiting

    def _poll_thread(self, devs: list[OpenDevice]) -> None:
        """The fallback when a completion channel's fd is not available."""
        assert self._loop is not None
        idle = 0
        while not self._stop.is_set():
            got = False
            for dev in devs:
                try:
                    n, wcs = dev.cq.poll(64)
                except self.api.Error:
                    return
                if n:
                    got = True
                    self._loop.call_soon_threadsafe(self._handle, dev, wcs)
            if got:
                idle = 0
            else:
                idle = min(idle + 1, 20)
                time.sleep(0.00005 * idle)

    def _handle(self, dev: OpenDevice, wcs: list[Any]) -> None:
        if self._closed:
            return
        for wc in wcs:
            q = self._qps.get((dev.name, int(wc.qp_num)))
            if isinstance(q, _Qp):
                self._send_done(q, wc)
            elif isinstance(q, _InQp):
                self._recv_done(q, wc)

    def _send_done(self, q: _Qp, wc: Any) -> None:
        wr_id = int(wc.wr_id)
        if wr_id >> ID_BITS != q.gen or q.state != READY:
            return  # a completion of an earlier generation (flushed by an error)
        status = int(wc.status)
        if status != self.E.IBV_WC_SUCCESS:
            self._stats["error_completions"] += 1
            self._qp_failed(q, status, wr_id & ID_MASK, self.api.status_text(status))
            return
        if not q.signaled:
            log.warning("unexpected send completion", qpn=q.qpn, wr_id=wr_id)
            return
        _, slots, w = q.signaled.popleft()
        q.used -= slots
        q.last_progress = time.monotonic()
        if w is not None:
            q.inflight.pop(w.id, None)
            if w.imm is not None:
                q.credits += 1
            self._stats["bytes_sent"] += w.length
            self._stats["writes"] += 1
            if not w.future.done():
                w.future.set_result(None)
        self._pump(q)

    def _recv_done(self, r: _InQp, wc: Any) -> None:
        if int(wc.wr_id) >> ID_BITS != r.gen or r.state != READY:
            return
        E = self.E
        if int(wc.status) != E.IBV_WC_SUCCESS:
            r.state = BROKEN  # the writer rebuilds it (Reset); reposting would only flush
            log.info(
                "incoming queue pair failed",
                peer=r.node,
                device=r.dev.name,
                qpn=r.qpn,
                status=self.api.status_text(int(wc.status)),
            )
            return
        try:
            r.qp.post_recv(r.recv)
        except self.api.Error as exc:
            r.state = BROKEN
            log.warning("could not repost a receive", peer=r.node, error=str(exc))
        if int(wc.opcode) == E.IBV_WC_RECV_RDMA_WITH_IMM:
            self._stats["imms_received"] += 1
            if self._on_imm is not None:
                try:
                    self._on_imm(socket.ntohl(int(wc.imm_data)), r.node)
                except Exception:
                    log.exception("immediate handler failed")

    def _qp_failed(self, q: _Qp, status: int | None, culprit: int, reason: str) -> None:
        """Fail every write on the QP, then rebuild the QP pair."""
        if q.state != READY:
            return
        E = self.E
        peer, link = q.link.peer, q.link
        where = f"{link.dev.name} -> {peer}:{link.dst_device} (qp {q.qpn})"
        lost = status is None or status in (
            E.get("IBV_WC_RETRY_EXC_ERR", 12),
            E.get("IBV_WC_RNR_RETRY_EXC_ERR", 13),
        )
        refused = status in (
            E.get("IBV_WC_REM_ACCESS_ERR", 10),
            E.get("IBV_WC_REM_INV_REQ_ERR", 9),
            E.get("IBV_WC_REM_OP_ERR", 11),
        )
        log.warning("write failed on a queue pair", peer=peer, where=where, error=reason)

        def error(w: _Write) -> TransferError:
            if lost:
                return PeerLostError(f"{peer} did not answer on {where}: {reason}")
            if w.id == culprit and refused:
                return RegionError(
                    f"{peer} refused the write on {where} ({reason}): wrong rkey, outside "
                    "the region, or the region is gone",
                    code=ErrorCode.UNAUTHORIZED,
                )
            if w.id == culprit:
                return TransferError(f"write to {peer} failed on {where}: {reason}")
            return TransferError(
                f"write to {peer} failed: another write failed on {where} ({reason}) while "
                "this one was in flight"
            )

        q.state = BROKEN
        q.gen += 1
        self._fail_writes(q, error)
        self._spawn(self._rebuild(q))

    def _fail_writes(self, q: _Qp, error: Callable[[_Write], TransferError]) -> None:
        writes = list(q.inflight.values()) + [w for w in q.queue if w.id not in q.inflight]
        q.inflight.clear()
        q.queue.clear()
        q.signaled.clear()
        q.used = q.run = 0
        for w in writes:
            if not w.future.done():
                self._stats["write_errors"] += 1
                w.future.set_exception(error(w))

    async def _watchdog(self) -> None:
        """A QP with work posted and no completion for stall_timeout_s is failed."""
        period = max(0.05, min(1.0, self.stall_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                for link in list(peer.links.values()):
                    for q in link.qps:
                        if (
                            q.state == READY
                            and q.used
                            and now - q.last_progress > (self.stall_timeout_s)
                        ):
                            self._qp_failed(
                                q,
                                None,
                                -1,
                                f"no completion for {self.stall_timeout_s:.0f} s",
                            )

    def stats(self) -> dict[str, int]:
        return dict(self._stats)
