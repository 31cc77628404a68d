"""The cuda transport: one-sided writes between regions of one host, by the GPU's copy
engines, over NVLink or PCIe.

The writer opens the destination's CUDA IPC handle (once) and copies into it on a lane
of the copying device, one per destination device (`lanes.py`: issued on the loop,
completed by a thread per lane). A bucket's writes are resolved once (`prepare`) and
only issued each version (`post`; where each write goes: `destinations.py`).
Only once a copy has landed is its immediate delivered (`delivery.py`): to this daemon's
own handler when the destination is local, to another transport in this process directly
(`neighbours.py`), or over a Unix datagram channel to another daemon of the same host.
Another daemon's regions it writes into (by their IPC handles) are let go once this
daemon's plans no longer name them (`remote.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import ClassVar

import structlog

from weightwire.memory.cudadrv import CudaError, Driver, driver
from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError
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
)

from . import lanes, neighbours
from .channel import Channel
from .delivery import Delivery
from .destinations import Destinations
from .inflight import REGIONS
from .ipc import IpcMaps
from .lanes import Fence, Lane
from .prepared import CudaPrepared, Epoch
from .regions import CudaRegions, Local
from .remote import RemoteRegions
from .slotevents import SlotEvents

log = structlog.get_logger("weightwire.transport.cuda")


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
        self._regions = CudaRegions(node, self.host)
        self._peers: dict[str, str] = {}  # node -> its channel path
        self._ipc: IpcMaps | None = None
        self._lanes: dict[tuple[int, int], Lane] = {}  # by (copying device, destination's)
        self._closing = False
        self._admit: Admit | None = None
        self._delivery = Delivery(node, self._channel, self._peers.get)
        self._remote = RemoteRegions(node)  # other daemons' regions it writes into
        self._letting_go: set[asyncio.Task[None]] = set()  # their mappings, once drained
        self._destinations = Destinations(node, self.host, self._regions, self._peers, self._remote)
        self.peers_enabled: list[tuple[int, int]] = []
        self._slot_events = SlotEvents()  # interprocess events fencing ring slots on lanes

    # --- lifecycle -----------------------------------------------------------

    async def start(self, on_imm: ImmHandler) -> None:
        self._drv = driver()
        if not self._drv.devices:
            raise CudaError("the CUDA driver sees no GPU")
        self._ipc = IpcMaps(self._drv)
        self._destinations.start(self._drv, self._ipc)
        self._loop = asyncio.get_running_loop()
        self._delivery.start(self._loop, on_imm)
        self.peers_enabled = await asyncio.to_thread(self._drv.enable_peer_access)
        log.info(
            "cuda transport ready", devices=len(self._drv.devices), p2p=len(self.peers_enabled)
        )
        self._channel.open(
            self._loop, lambda imm, source: self._delivery.receive([imm], source), self._bye
        )
        neighbours.add(self.node, self)
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
        neighbours.remove(self.node)
        Epoch.bump()
        for node, path in list(self._peers.items()):  # tell same-host peers we are gone
            other = neighbours.get(node)
            if other is not None:
                other.peer_gone(self.node)
            else:
                self._channel.send_bye(path, self.node)
        for task in list(self._letting_go):  # every mapping is closed below
            task.cancel()
        await asyncio.gather(*self._letting_go, return_exceptions=True)
        stopping = list(self._lanes.values())
        self._lanes.clear()
        for lane in stopping:
            await lane.stop()

        def join() -> None:
            for lane in stopping:
                lane.join(10)

        await asyncio.to_thread(join)
        self._regions.close()
        self._remote.close()
        self._slot_events.close(self._drv)
        self._channel.close()
        if self._ipc is not None:
            self._ipc.close()

    # --- regions -------------------------------------------------------------

    def register(self, region: LocalRegion) -> RegionKeys:
        return self._regions.register(self._drv, region)

    def deregister(self, region_id: int) -> None:
        """Copies into it not issued yet (queued on a lane of this process) are refused
        `peer_lost`; those issued fail too once they finish (`inflight.py`)."""
        self._regions.deregister(self._drv, region_id)

    def drained(self, region_id: int, timeout_s: float) -> bool:
        """Once no copy is into it: the peer mappings made here of its allocation (a copy
        from another GPU goes through one, `Destinations._mapped`) are closed too."""
        if not REGIONS.drained((self.node, region_id), timeout_s):
            return False
        handle = self._regions.drained(region_id)
        if handle and self._ipc is not None:
            self._ipc.forget(handle)
        return True

    def peer_regions(self, regions: Collection[RegionDescriptor]) -> None:
        """The regions of other nodes this daemon's plans name now: one of another daemon
        written into through its IPC handle and named no more is let go (`remote.py`):
        writes into it refused peer_lost, its mapping closed once its copies are done."""
        changed, closing = self._remote.keep(regions)
        if changed:
            Epoch.bump()  # prepared writes resolve again: into a region let go, refused
        if self._ipc is None or self._loop is None:
            return
        for handle, keys in closing.items():
            task = self._loop.create_task(self._remote.let_go(handle, keys, self._ipc))
            self._letting_go.add(task)
            task.add_done_callback(self._letting_go.discard)

    # --- what other cuda transports of this process ask (`neighbours.Neighbour`) ----

    def region(self, region_id: int) -> Local | None:
        return self._regions.get(region_id)

    def missing(self, region_id: int) -> RegionError | PeerLostError:
        return self._regions.missing(region_id, self.node)

    def admits(self, source: str, imm: int) -> bool:
        return self._admit is None or self._admit(source, imm)

    def take_imms(
        self, imms: list[int], source: str, from_loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self._delivery.take(imms, source, from_loop)

    def peer_gone(self, node: str) -> None:
        self._peers.pop(node, None)

    async def fence_writes(
        self, to_node: str, err: BaseException, from_loop: asyncio.AbstractEventLoop | None
    ) -> None:
        if self._loop is None:
            return
        if self._loop is from_loop:
            await self._fence_lanes(to_node, err)
        else:
            done = asyncio.run_coroutine_threadsafe(self._fence_lanes(to_node, err), self._loop)
            await asyncio.wrap_future(done)

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
        writer = self if node == self.node else neighbours.get(node)
        if writer is None:
            return
        err = PeerLostError(f"{self.node} fenced writes from {node}: {reason}")
        await writer.fence_writes(self.node, err, self._loop)

    async def _fence_lanes(self, to_node: str, err: BaseException) -> None:
        await asyncio.gather(*(lane.fence(to_node, err) for lane in list(self._lanes.values())))

    def _refused(self, p: CudaPrepared, imms: Sequence[int | None]) -> BaseException | None:
        """A failed version's writes into memory of this process are never issued: the
        destination's admission check, asked before the copies are."""
        for r, imm in zip(p.requests, imms, strict=True):
            if imm is None:
                continue
            owner = self if r.dst.node == self.node else neighbours.get(r.dst.node)
            if owner is not None and not owner.admits(self.node, imm):
                return RegionError(
                    f"write to region {r.dst.id} of {r.dst.node} belongs to a version it failed",
                    code=ErrorCode.ABORTED,
                )
        return None

    def prepare(self, requests: Sequence[WriteRequest]) -> CudaPrepared:
        """Each write checked, its destination resolved to a pointer the copying device can
        write, and the lane's chunks cut, once; `post` only issues them."""
        prepared = CudaPrepared(requests, self)
        self._destinations.resolve(prepared)
        return prepared

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
            self._destinations.resolve(p)
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
                self._delivery.landed,
                lanes.MAX_OPS_IN_FLIGHT,
                name=f"ww-cuda-{device}-{peer}",
            )
        return lane

    def deliver_written(self, node: str, imms: Sequence[int]) -> bool:
        return self._delivery.written(node, imms)

    def _bye(self, node: str) -> None:
        """A daemon of this host closed its cuda transport."""
        if self._peers.pop(node, None) is not None:
            Epoch.bump()

    def stats(self) -> dict[str, int]:
        """The delivery's counters, and `ipc_mappings`: allocations mapped here by their
        IPC handle now (another daemon's regions written into; this one's, per device)."""
        held = self._ipc.held() if self._ipc is not None else 0
        return {**self._delivery.stats(), "ipc_mappings": held}
