"""The verbs transport: one-sided RDMA WRITEs from registered memory into a peer's
registered memory, over RC queue pairs, with WRITE_WITH_IMM carrying the immediate.

`VerbsTransport` composes the parts, each a module of this package (see the README's
"RDMA (verbs)" section for the knobs):

- `runtime`: what the parts share: the open devices (one protection domain, one
  completion queue and channel each), the queue-pair table completions are routed by,
  the counters, the worker threads blocking verbs calls run on.
- `regions`: a region is registered once per NIC of its lane set (a GPU's affine NICs,
  or the host NICs); its keys (device, address, rkey) go to peers inside the region
  descriptor.
- `mesh`: bring-up requests to a peer's verbs transport over the daemons' mesh;
  `on_signal` below answers them.
- `checks`: a post checks the descriptor with its owner once (`Check`: unknown region,
  wrong key, length beyond the real region are refused with their own codes).
- `links`: a writer owns "links": per (local device, remote device) pair, `qps_per_peer`
  RC queue pairs brought up through the mesh (`Connect`: QPN, PSN, GID, MTU both ways),
  rebuilt after an error (RESET -> INIT -> RTR -> RTS, new PSNs, the peer's receives
  re-posted), failed by a watchdog when stalled.
- `send`: a write is queued on the least busy QP of the lane's link, cut into WRs of at
  most the chunk size, posted in chains of `wr_per_post`, with signaled-slot accounting;
  it resolves on its last WR's send completion.
- `recv`: the destination keeps `recv_depth` receives posted on each incoming QP and
  delivers the immediate on its RECV_RDMA_WITH_IMM completion, which comes only after
  the bytes are visible.
- `completions`: completion queues drained on the event loop when the channel's fd is
  readable, or polled by a thread where the fd cannot be had.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Sequence
from typing import ClassVar

import structlog

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    ProtocolError,
    RegionError,
    TransferError,
    WeightwireError,
)
from weightwire.protocol.regions import (
    RegionDescriptor,
    RegionKeys,
    TransportEndpoints,
    VerbsEndpoint,
)
from weightwire.transport.base import (
    ImmHandler,
    LocalRegion,
    Prepared,
    Signal,
    Transport,
    WriteRequest,
    check_write,
    post_each,
)

from . import wire
from .checks import FAULT_ENV, Checks
from .completions import Completions, Delivery
from .devices import DeviceInfo, discover
from .hw import OpenDevice
from .ibv import Api, load
from .links import Links
from .mesh import Mesh
from .recv import Receiver
from .regions import Regions
from .runtime import Runtime
from .send import Sender

__all__ = ["FAULT_ENV", "Completions", "VerbsTransport"]

log = structlog.get_logger("weightwire.transport.verbs")


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
        self.infos: list[DeviceInfo] = discover(devices, gid_index, self.api)
        self.completions = completions
        rt = self._rt = Runtime(node, self.api, [i.name for i in self.infos])
        self._mesh = Mesh(node, self.on_signal, signal_timeout_s)
        self._regions = Regions(
            rt,
            nics_per_gpu=nics_per_gpu,
            host_nics=host_nics,
            relaxed_ordering=relaxed_ordering,
            sysfs=sysfs,
        )
        self._checks = Checks(rt, self._mesh, self._regions)
        self._sender = Sender(rt, on_broken=lambda q: self._links.rebuild_later(q))
        self._links = Links(
            rt,
            self._mesh,
            self._sender,
            chunk_bytes=chunk_bytes,
            wr_per_post=wr_per_post,
            qps_per_peer=qps_per_peer,
            send_depth=max(send_depth, 2 * wr_per_post, 4),
            stall_timeout_s=stall_timeout_s,
        )
        self._receiver = Receiver(rt, recv_depth)
        self._delivery = Delivery(rt, self._sender.send_done, self._receiver.recv_done)

    # --- lifecycle -----------------------------------------------------------

    async def start(self, on_imm: ImmHandler) -> None:
        rt = self._rt
        rt.loop = asyncio.get_running_loop()
        self._receiver.on_imm = on_imm
        want_channel = self.completions in ("auto", "channel")
        for info in self.infos:
            dev = await rt.thread(
                functools.partial(OpenDevice, self.api, info, channel=want_channel)
            )
            rt.devs[info.name] = dev
            if dev.fd is None and self.completions == "channel":
                raise TransferError(f"{info.name}: no completion channel fd to wait on")
        polled = self._delivery.start(list(rt.devs.values()))
        rt.spawn(self._links.watchdog())
        log.info(
            "verbs transport up",
            devices=[d.info.describe() for d in rt.devs.values()],
            completions="thread" if polled else "channel",
            pyverbs=self.api.version,
        )

    def set_signal(self, signal: Signal) -> None:
        self._mesh.signal = signal

    def endpoints(self) -> TransportEndpoints:
        return TransportEndpoints(
            verbs=VerbsEndpoint(
                devices=tuple(self._rt.order), gids=tuple(i.gid for i in self.infos)
            )
        )

    def can_reach(self, endpoints: TransportEndpoints) -> bool:
        return endpoints.verbs is not None and bool(endpoints.verbs.devices)

    def accepts(self, src: LocalRegion, dst: RegionDescriptor) -> bool:
        return bool(dst.keys.verbs) and src.id in self._regions

    async def close(self) -> None:
        rt = self._rt
        if rt.closed:
            return
        rt.closed = True
        for task in list(rt.tasks):
            task.cancel()
        self._links.close("the verbs transport is closing")
        self._receiver.close()
        self._delivery.stop()
        deadline = time.monotonic() + 5.0
        while rt.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self._delivery.join(5.0)
        self._regions.close()
        rt.qp_ops = 0  # waited for above (bounded): everything left goes now
        rt.retire([])
        for dev in rt.devs.values():
            dev.close()
        rt.devs.clear()
        rt.qps.clear()

    # --- regions ---------------------------------------------------------------

    def lanes(self, device_uuid: str) -> int:
        return self._regions.lanes(device_uuid)

    def register(self, region: LocalRegion) -> RegionKeys:
        """Pin the region on each NIC of its lanes (on a worker thread in the daemon)."""
        return self._regions.register(region)

    def deregister(self, region_id: int) -> None:
        self._regions.deregister(region_id)

    # --- peers -----------------------------------------------------------------

    async def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        if self._rt.closed:
            raise PeerLostError("the verbs transport is closed")
        if endpoints.verbs is None or not endpoints.verbs.devices:
            raise PeerLostError(f"node {node} has no verbs endpoint")
        self._links.connect(node, endpoints)

    async def disconnect(self, node: str, reason: str) -> None:
        self._links.disconnect(node, reason)
        self._receiver.drop_node(node)

    async def fence(self, node: str, reason: str) -> None:
        """`node`'s incoming queue pairs go to the error state before this returns; its
        writer must connect again (new queue pairs) to write here. Memory keys stay: the
        fabric is trusted (see the README's trust model)."""
        links = await self._receiver.fence_node(node)
        log.info("verbs fenced", peer=node, links=len(links), reason=reason)
        if links:  # the writer may be stopped: tell it without waiting for it
            self._rt.spawn(self._tell_fenced(node, tuple(links)))

    async def _tell_fenced(self, node: str, links: tuple[int, ...]) -> None:
        try:
            await self._mesh.ask(node, wire.Fenced(links=links))
        except WeightwireError as exc:
            log.info("writer not told of its fence", peer=node, error=exc.message)

    async def on_signal(self, node: str, payload: bytes) -> bytes:
        """Requests from writers on other nodes. Always answers (refusals carry a code)."""
        try:
            req = wire.decode_request(payload)
        except ProtocolError as exc:
            return wire.encode(wire.Refused(code=ErrorCode.MALFORMED.value, message=exc.message))
        if self._rt.closed or not self._rt.devs:
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
                    reply = self._checks.answer(req)
                case wire.Connect():
                    reply = await self._receiver.accept_connect(node, req)
                case wire.Reset():
                    reply = await self._receiver.accept_reset(node, req)
                case wire.Fenced(links=links):
                    self._links.fenced(node, links)
                    reply = wire.Accepted()
                case wire.Close(link=link):
                    if link is None:
                        self._receiver.drop_node(node)
                    else:
                        self._receiver.drop(node, link)
                    reply = wire.Accepted()
        except WeightwireError as exc:
            reply = wire.Refused(code=exc.code.value, message=exc.message)
        except self.api.Error as exc:
            reply = wire.Refused(code=ErrorCode.TRANSFER.value, message=f"{self.node}: {exc}")
        return wire.encode(reply)

    # --- writing -------------------------------------------------------------------

    def prepare(self, requests: Sequence[WriteRequest]) -> Prepared:
        """Nothing to resolve up front: each post checks its writes (and their
        descriptors, once per region key: `checks`)."""
        return Prepared(requests)

    async def post(
        self, prepared: Prepared, imms: Sequence[int | None]
    ) -> list[BaseException | None]:
        return await post_each(self._write_one, prepared, imms)

    async def _write_one(self, r: WriteRequest, imm: int | None) -> None:
        check_write(r)
        src, dst, lane = r.src, r.dst, r.lane
        if not dst.keys.verbs:
            raise RegionError(f"region {dst.id} of node {dst.node} has no verbs key")
        reg = self._regions.get(src.id)
        if reg is None:
            raise RegionError(f"source region {src.id} is not registered with verbs")
        if self._rt.closed:
            raise PeerLostError("the verbs transport is closed")
        peers = self._links.peers
        peer = peers.get(dst.node)
        if peer is None:
            raise PeerLostError(f"not connected to node {dst.node}")
        sdev = reg.devices[lane % len(reg.devices)]
        key = dst.keys.verbs[lane % len(dst.keys.verbs)]
        await self._checks.validate(peer, dst, key)
        if peers.get(dst.node) is not peer:
            raise PeerLostError(f"{dst.node} was disconnected")
        link = await self._links.link(peer, sdev, key.device)
        if peers.get(dst.node) is not peer or link.dead:
            raise PeerLostError(link.dead or f"{dst.node} was disconnected")
        await self._sender.submit(
            link,
            local_addr=reg.base + r.src_offset,
            lkey=int(reg.mrs[sdev].lkey),
            remote_addr=key.addr + r.dst_offset,
            rkey=self._checks.fault(key.rkey),
            length=r.length,
            imm=imm,
            count=r.count,
            src_stride=r.src_stride,
            dst_stride=r.dst_stride,
        )

    def stats(self) -> dict[str, int]:
        return dict(self._rt.stats)
