"""The cuda transport: one-sided writes between regions of one host, by the GPU's copy
engines, over NVLink or PCIe.

The writer opens the destination's CUDA IPC handle (once) and copies into it on a lane
of the copying device, one per destination device (`lanes.py`: issued on the loop,
completed by a thread per lane). A bucket's writes are resolved once (`prepare`) and
only issued each version (`post`).
Only once a copy has landed is its immediate delivered: to this daemon's own handler when
the destination is local, to another transport in this process directly, or over a Unix
datagram channel to another daemon of the same host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import structlog

from weightwire.memory.cudadrv import CudaError, Driver, driver
from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError, WeightwireError
from weightwire.protocol.plan import span
from weightwire.protocol.regions import (
    CudaEndpoint,
    RegionDescriptor,
    RegionKeys,
    TransportEndpoints,
)
from weightwire.transport.base import (
    Admit,
    Gate,
    ImmHandler,
    LocalRegion,
    Prepared,
    Transport,
    WriteRequest,
    check_write,
)

from . import lanes
from .channel import Channel
from .ipc import IpcMaps
from .lanes import Batch, Copy, Fence, Lane
from .prepared import CudaPrepared, Epoch
from .regions import CudaRegions
from .slotevents import SlotEvents

log = structlog.get_logger("weightwire.transport.cuda")

# How a copy between two GPUs is issued: "map" opens the destination's IPC handle in the
# copying device's context (peer mapping), "peer" names both contexts (cuMemcpyPeerAsync),
# "plain" relies on unified addressing alone.
P2P = os.environ.get("WEIGHTWIRE_CUDA_P2P", "map")
_INSTANCES: dict[str, CudaTransport] = {}  # transports of this process, by node


def host_id() -> str:
    """Identifies this machine (and boot): GPU memory is shareable within one host only."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        with contextlib.suppress(OSError), open(path) as f:
            parts.append(f.read().strip())
    return "-".join(parts) or socket.gethostname()


class CudaTransport(Transport):
    name: ClassVar[str] = "cuda"

    def __init__(self, node: str, *, channel_dir: str | None = None) -> None:
        self.node = node
        self.host = host_id()
        self._channel = Channel(channel_dir)
        self._drv: Driver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_imm: ImmHandler | None = None
        self._regions = CudaRegions(self.host)
        self._peers: dict[str, str] = {}  # node -> its channel path
        self._ipc: IpcMaps | None = None
        self._lanes: dict[tuple[int, int], Lane] = {}  # by (copying device, destination's)
        self._closing = False
        self._admit: Admit | None = None
        self._lock = threading.Lock()
        self._stats = {"bytes_sent": 0, "writes": 0, "bytes_received": 0, "batches": 0}
        self.peers_enabled: list[tuple[int, int]] = []
        self._slot_events = SlotEvents()  # interprocess events fencing ring slots on lanes

    # --- lifecycle -----------------------------------------------------------

    async def start(self, on_imm: ImmHandler) -> None:
        self._drv = driver()
        if not self._drv.devices:
            raise CudaError("the CUDA driver sees no GPU")
        self._ipc = IpcMaps(self._drv)
        self._loop = asyncio.get_running_loop()
        self._on_imm = on_imm
        self.peers_enabled = await asyncio.to_thread(self._drv.enable_peer_access)
        log.info(
            "cuda transport ready", devices=len(self._drv.devices), p2p=len(self.peers_enabled)
        )
        self._channel.open(self._loop, lambda imm, source: self._receive([imm], source), self._bye)
        _INSTANCES[self.node] = self
        Epoch.bump()

    def endpoints(self) -> TransportEndpoints:
        return TransportEndpoints(cuda=CudaEndpoint(host_id=self.host, channel=self._channel.path))

    def can_reach(self, endpoints: TransportEndpoints) -> bool:
        return endpoints.cuda is not None and endpoints.cuda.host_id == self.host

    def accepts(self, src: LocalRegion, dst: RegionDescriptor) -> bool:
        """GPU destinations of this host (from GPU or pinned host memory)."""
        return dst.kind == "gpu" and (dst.node == self.node or dst.keys.cuda is not None)

    async def close(self) -> None:
        self._closing = True
        _INSTANCES.pop(self.node, None)
        Epoch.bump()
        for node, path in list(self._peers.items()):  # tell same-host peers we are gone
            other = _INSTANCES.get(node)
            if other is not None:
                other._peers.pop(self.node, None)
            else:
                self._channel.send_bye(path, self.node)
        stopping = list(self._lanes.values())
        self._lanes.clear()
        for lane in stopping:
            await lane.stop()

        def join() -> None:
            for lane in stopping:
                lane.join(10)

        await asyncio.to_thread(join)
        self._slot_events.close(self._drv)
        self._channel.close()
        if self._ipc is not None:
            self._ipc.close()

    # --- regions -------------------------------------------------------------

    def register(self, region: LocalRegion) -> RegionKeys:
        return self._regions.register(self._drv, region)

    def deregister(self, region_id: int) -> None:
        self._regions.deregister(self._drv, region_id)

    # --- data path -----------------------------------------------------------

    async def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        ep = endpoints.cuda
        if ep is None or ep.host_id != self.host:
            raise PeerLostError(f"node {node} is not on this host; cuda cannot reach it")
        if self._peers.get(node) != ep.channel:  # connecting again changes nothing
            self._peers[node] = ep.channel
            Epoch.bump()

    async def disconnect(self, node: str, reason: str) -> None:
        if self._peers.pop(node, None) is not None:
            Epoch.bump()

    def set_admission(self, admit: Admit) -> None:
        self._admit = admit

    async def fence(self, node: str, reason: str) -> None:
        """The writer's lanes are in this process when `node` is this node (or another
        transport of this process): queued copies into this node's memory fail, issued ones
        are waited for. A writer in another process copies with its own lanes; it learns
        of the failure through its daemon (see the README's trust model)."""
        writer = self if node == self.node else _INSTANCES.get(node)
        if writer is None or writer._loop is None:
            return
        err = PeerLostError(f"{self.node} fenced writes from {node}: {reason}")
        if writer._loop is self._loop:
            await writer._fence_lanes(self.node, err)
        else:
            done = asyncio.run_coroutine_threadsafe(
                writer._fence_lanes(self.node, err), writer._loop
            )
            await asyncio.wrap_future(done)

    async def _fence_lanes(self, to_node: str, err: BaseException) -> None:
        await asyncio.gather(*(lane.fence(to_node, err) for lane in list(self._lanes.values())))

    def _refused(self, p: CudaPrepared, imms: Sequence[int | None]) -> BaseException | None:
        """A failed version's writes into memory of this process are never issued: the
        destination's admission check, asked before the copies are."""
        for r, imm in zip(p.requests, imms, strict=True):
            if imm is None:
                continue
            owner = self if r.dst.node == self.node else _INSTANCES.get(r.dst.node)
            if owner is not None and owner._admit is not None and not owner._admit(self.node, imm):
                return RegionError(
                    f"write to region {r.dst.id} of {r.dst.node} belongs to a version it failed",
                    code=ErrorCode.ABORTED,
                )
        return None

    def _destination(self, dst: RegionDescriptor, dst_offset: int, length: int) -> tuple[int, int]:
        """(device pointer, device ordinal) of the write's first destination byte."""
        assert self._drv is not None
        if dst.node != self.node and dst.node not in self._peers:
            raise PeerLostError(f"not connected to node {dst.node}")
        if dst.node == self.node or dst.node in _INSTANCES:
            owner = self if dst.node == self.node else _INSTANCES[dst.node]
            local = owner._regions.get(dst.id)
            if local is None:
                raise RegionError(
                    f"unknown region {dst.id} of {dst.node}", code=ErrorCode.UNKNOWN_REGION
                )
            local.region.check(dst_offset, length, "write")
            assert local.region.device is not None
            return local.region.address + dst_offset, local.region.device
        key = dst.keys.cuda
        if key is None or key.host_id != self.host:
            raise RegionError(f"region {dst.id} of {dst.node} is not reachable by cuda")
        assert self._ipc is not None
        base, size = self._ipc.opened(key.ipc_handle, self._drv.ordinal_of(key.device_uuid))
        if key.offset + dst.length > size:
            raise RegionError(
                f"region {dst.id} of {dst.node} claims {dst.length} bytes at offset {key.offset} "
                f"of a {size}-byte allocation",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        return base + key.offset + dst_offset, self._drv.ordinal_of(key.device_uuid)

    def _mapped(self, dst: RegionDescriptor, ptr: int, dst_dev: int, device: int) -> int:
        """`ptr` (in `dst`, on GPU dst_dev) as the copying device sees it: the destination's
        IPC handle opened once in `device`'s context, so its copy engine writes peer to peer."""
        assert self._ipc is not None
        owner = self if dst.node == self.node else _INSTANCES.get(dst.node)
        local = owner._regions.get(dst.id) if owner is not None else None
        if local is not None and not local.handle:  # VMM: mapped for every device already
            return ptr
        if local is not None:
            handle, base = local.handle, local.region.address - local.offset
        elif dst.keys.cuda is not None:
            handle = dst.keys.cuda.ipc_handle
            base = self._ipc.base_of(handle)
        else:
            return ptr
        mapped = self._ipc.mapped(handle, device)
        return ptr if not mapped else mapped + (ptr - base)

    def prepare(self, requests: Sequence[WriteRequest]) -> CudaPrepared:
        """Each write checked, its destination resolved to a pointer the copying device can
        write, and the lane's chunks cut, once; `post` only issues them."""
        prepared = CudaPrepared(requests, self)
        self._resolve(prepared)
        return prepared

    def _resolve(self, prepared: CudaPrepared) -> None:
        epoch = Epoch.value
        requests = prepared.requests
        failed: list[tuple[int, BaseException]] = []
        by_lane: dict[tuple[int, int], list[Copy]] = {}
        pageable: set[tuple[int, int]] = set()  # lanes with a copy from unpinned host memory
        for i, r in enumerate(requests):
            try:
                check_write(r)
                dst_ptr, dst_dev = self._destination(
                    r.dst, r.dst_offset, span(r.length, r.count, r.dst_stride)
                )
            except WeightwireError as exc:
                failed.append((i, exc))
                continue
            device = r.src.device if r.src.kind == "gpu" and r.src.device is not None else dst_dev
            peer_device = -1
            if device != dst_dev and r.src.kind == "gpu":
                if P2P == "map":
                    dst_ptr = self._mapped(r.dst, dst_ptr, dst_dev, device)
                elif P2P == "peer":
                    peer_device = dst_dev
            copy = Copy(
                i,
                dst_ptr,
                r.src.address + r.src_offset,
                r.length,
                r.dst.node,
                dst_device=peer_device,
                count=r.count,
                src_stride=r.src_stride,
                dst_stride=r.dst_stride,
            )
            key = (device, dst_dev)
            by_lane.setdefault(key, []).append(copy)
            if r.src.kind != "gpu" and not self._regions.pinned_at(r.src.id, r.src.address):
                pageable.add(key)
        prepared.epoch, prepared.failed = epoch, failed
        prepared.lanes = [(key, lanes.chunks(cs), key in pageable) for key, cs in by_lane.items()]

    async def post(
        self, prepared: Prepared, imms: Sequence[int | None]
    ) -> list[BaseException | None]:
        return await self._post(self._current(prepared, imms), imms)

    def _current(self, prepared: Prepared, imms: Sequence[int | None]) -> CudaPrepared:
        """`prepared` as this transport resolved it, resolved again if something changed
        (or may have) since: what a post issues."""
        if len(imms) != len(prepared.requests):
            raise ValueError(f"{len(imms)} immediates for {len(prepared.requests)} writes")
        p = prepared
        if not isinstance(p, CudaPrepared) or p.owner is not self:
            p = self.prepare(prepared.requests)
        elif p.epoch != Epoch.value or p.failed:  # something changed, or may have: again
            self._resolve(p)
        return p

    async def post_fenced(
        self,
        prepared: Prepared,
        imms: Sequence[int | None],
        slot: Hashable,
        on_issued: Callable[[tuple[bytes, ...]], None],
    ) -> list[BaseException | None]:
        """As `post`, and once every copy is issued (queued on its lane's stream),
        `on_issued` gets the IPC handles of the events each lane recorded right after its
        last copy: one event per (`slot`, lane), recorded again by the next post for the
        same slot. Not called if any write failed before issuing or no event could be made
        (then only the landing tells that the source is free)."""
        return await self._post(self._current(prepared, imms), imms, (slot, on_issued))

    async def post_gated(
        self,
        prepared: Prepared,
        imms: Sequence[int | None],
        gate: Gate,
        fencing: tuple[Hashable, Callable[[tuple[bytes, ...]], None]] | None = None,
    ) -> list[BaseException | None]:
        """As `post` (`post_fenced` with `fencing`: (slot, on_issued)), the copies of each
        lane from `gate.device` waiting on the GPU for `gate` first (they are the ones that
        read the rank's staging; the others read what no packing writes). Its lanes get
        the post at once, in this call: posts made in an order are issued in that order."""
        return await self._post(self._current(prepared, imms), imms, fencing, gate)

    def events_of(self, handles: Sequence[bytes]) -> list[int] | None:
        """The events behind slot events' IPC handles (as `post_fenced` gave them), for a
        stream of this process to wait on; None if one is not this transport's."""
        return self._slot_events.of(handles)

    async def _post(
        self,
        p: CudaPrepared,
        imms: Sequence[int | None],
        fencing: tuple[Hashable, Callable[[tuple[bytes, ...]], None]] | None = None,
        gate: Gate | None = None,
    ) -> list[BaseException | None]:
        """Issue resolved writes on their lanes; each one's outcome, in order. `fencing`:
        (slot, on_issued), as `post_fenced`; `gate`, as `post_gated`. Every lane's post
        is made before the first await."""
        refused = self._refused(p, imms)
        if refused is not None:
            return [refused] * len(imms)
        results: list[BaseException | None] = [None] * len(imms)
        for i, exc in p.failed:
            results[i] = exc
        fence_of: dict[tuple[int, int], Fence] = {}
        if fencing is not None and not p.failed:
            assert self._drv is not None
            slot, on_issued = fencing
            fence_of = self._slot_events.fences(
                self._drv, slot, [key for key, _, _ in p.lanes], on_issued
            )
        posts = []
        for key, chunks, pageable in p.lanes:
            try:
                lane = self._lane(*key)
            except (CudaError, PeerLostError) as exc:
                for chunk in chunks:
                    for c in chunk.copies:
                        results[c.index] = exc
                continue
            posted = [(chunk, [imms[c.index] for c in chunk.copies]) for chunk in chunks]
            gated = gate is not None and key[0] == gate.device
            wait = (gate.address, gate.value) if gate is not None and gated else None
            posts.append(lane.post(posted, blocking=pageable, fence=fence_of.get(key), gate=wait))
        for failures in await asyncio.gather(*posts):
            for i, failure in failures.items():
                results[i] = failure
        return results

    def _lane(self, device: int, peer: int) -> Lane:
        if self._closing:
            raise PeerLostError(f"the cuda transport of {self.node} is closed")
        lane = self._lanes.get((device, peer))
        if lane is None:
            assert self._drv is not None and self._loop is not None
            lane = self._lanes[device, peer] = Lane(
                self._drv,
                device,
                self._loop,
                self._landed,
                lanes.MAX_OPS_IN_FLIGHT,
                name=f"ww-cuda-{device}-{peer}",
            )
        return lane

    def _landed(self, batch: Batch) -> None:
        """On the loop: a batch's copies are done; deliver the immediates of those that landed."""
        chunk, failed = batch.chunk, batch.failures
        if not failed:
            nbytes, writes = chunk.nbytes, len(chunk.copies)
        else:
            landed = [c for c in chunk.copies if c.index not in failed]
            nbytes, writes = sum(c.size for c in landed), len(landed)
        with self._lock:
            self._stats["bytes_sent"] += nbytes
            self._stats["writes"] += writes
            self._stats["batches"] += 1
        imms: dict[str, list[int]] = {}
        if chunk.node and not failed:
            imms[chunk.node] = [imm for imm in batch.imms if imm is not None]
        else:
            for c, imm in zip(chunk.copies, batch.imms, strict=True):
                if imm is not None and c.index not in failed:
                    imms.setdefault(c.dst_node, []).append(imm)
        for node, values in imms.items():
            if not values:
                continue
            try:
                delivered = self._deliver(node, values)
            except Exception as exc:  # one destination's handler must not strand the rest
                log.error("immediates not delivered", peer=node, count=len(values), error=repr(exc))
                continue
            if not delivered:  # the bytes are there, the destination will never know
                lost = PeerLostError(f"node {node} went away before it was told of the write")
                for c, imm in zip(chunk.copies, batch.imms, strict=True):
                    if imm is not None and c.dst_node == node:
                        failed.setdefault(c.index, lost)

    def deliver_written(self, node: str, imms: Sequence[int]) -> bool:
        if not imms:
            return True
        delivered = self._deliver(node, list(imms))
        if delivered:
            with self._lock:
                self._stats["in_place_writes"] = self._stats.get("in_place_writes", 0) + len(imms)
        return delivered

    def _deliver(self, node: str, imms: list[int]) -> bool:
        """Immediates of finished copies, to whichever transport owns the destination;
        False if no one is there to take them (disconnected meanwhile)."""
        owner = self if node == self.node else _INSTANCES.get(node)
        if owner is not None:
            if owner._loop is self._loop:
                owner._receive(imms, self.node)
            else:
                assert owner._loop is not None
                owner._loop.call_soon_threadsafe(owner._receive, imms, self.node)
            return True
        path = self._peers.get(node)
        if path is None:
            return False
        self._channel.send_imms(path, self.node, imms)
        return True

    def _receive(self, imms: list[int], source: str) -> None:
        if self._on_imm is not None:
            for imm in imms:
                self._on_imm(imm, source)

    def _bye(self, node: str) -> None:
        """A daemon of this host closed its cuda transport."""
        if self._peers.pop(node, None) is not None:
            Epoch.bump()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)
