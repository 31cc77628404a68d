"""Where the cuda transport's writes go: each write checked, its destination resolved to
a pointer the copying device can write (a region of this transport, of another cuda
transport of this process, or another process's allocation opened by its CUDA IPC
handle), and the writes cut into chunks per lane, once per `prepare` (and again when the
`Epoch` says something may have changed)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from weightwire.memory.cudadrv import Driver
from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError, WeightwireError
from weightwire.protocol.plan import span
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import check_write

from . import copies, neighbours
from .copies import Copy
from .ipc import IpcMaps
from .prepared import CudaPrepared, Epoch
from .regions import CudaRegions, Local
from .remote import RemoteRegions

# How a copy between two GPUs is issued: "map" opens the destination's IPC handle in the
# copying device's context (peer mapping), "peer" names both contexts (cuMemcpyPeerAsync),
# "plain" relies on unified addressing alone.
P2P = os.environ.get("WEIGHTWIRE_CUDA_P2P", "map")


class Destinations:
    """Resolves one cuda transport's writes (its driver and IPC maps set by `start`)."""

    def __init__(
        self,
        node: str,
        host: str,
        regions: CudaRegions,
        peers: Mapping[str, str],
        remote: RemoteRegions | None = None,
    ) -> None:
        self.node, self.host = node, host
        self._regions = regions
        self.remote = remote or RemoteRegions(node)  # other daemons' regions written into
        self._peers = peers  # connected same-host nodes (node -> channel path)
        self.drv: Driver | None = None
        self.ipc: IpcMaps | None = None

    def start(self, drv: Driver, ipc: IpcMaps) -> None:
        self.drv, self.ipc = drv, ipc

    def _region(self, node: str, region_id: int) -> Local | None:
        """Region `region_id` of `node` when `node` is a transport of this process."""
        if node == self.node:
            return self._regions.get(region_id)
        owner = neighbours.get(node)
        return owner.region(region_id) if owner is not None else None

    def _missing(self, node: str, region_id: int) -> RegionError | PeerLostError:
        """The refusal of a write into a region of `node` (a transport of this process)
        that is not registered: `gone` if it was (`RemovedRegions`), else unknown_region."""
        if node == self.node:
            return self._regions.missing(region_id, node)
        owner = neighbours.get(node)
        if owner is None:
            return PeerLostError(f"not connected to node {node}")
        return owner.missing(region_id)

    def _destination(
        self, dst: RegionDescriptor, dst_offset: int, length: int
    ) -> tuple[int, int, int, str]:
        """(device pointer, device ordinal) of the write's first destination byte, the
        registration it was resolved against and where its copies are counted (`Copy.via`;
        "" for a region of this process). A region of another daemon that the plans no
        longer name is refused peer_lost before its handle is opened (`remote.py`)."""
        if dst.node != self.node and dst.node not in self._peers:
            raise PeerLostError(f"not connected to node {dst.node}")
        if dst.node == self.node or neighbours.get(dst.node) is not None:
            local = self._region(dst.node, dst.id)
            if local is None:  # peer_lost when its rank left (deregistered): retryable
                raise self._missing(dst.node, dst.id)
            local.region.check(dst_offset, length, "write")
            assert local.region.device is not None
            return local.region.address + dst_offset, local.region.device, local.token, ""
        key = dst.keys.cuda
        if key is None or key.host_id != self.host:
            raise RegionError(f"region {dst.id} of {dst.node} is not reachable by cuda")
        token, via = self.remote.resolve(dst.node, dst.id, key.ipc_handle)
        assert self.drv is not None and self.ipc is not None
        base, size = self.ipc.opened(key.ipc_handle, self.drv.ordinal_of(key.device_uuid))
        if key.offset + dst.length > size:
            raise RegionError(
                f"region {dst.id} of {dst.node} claims {dst.length} bytes at offset {key.offset} "
                f"of a {size}-byte allocation",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        return base + key.offset + dst_offset, self.drv.ordinal_of(key.device_uuid), token, via

    def _mapped(self, dst: RegionDescriptor, ptr: int, dst_dev: int, device: int) -> int:
        """`ptr` (in `dst`, on GPU dst_dev) as the copying device sees it: the destination's
        IPC handle opened once in `device`'s context, so its copy engine writes peer to peer."""
        assert self.ipc is not None
        local = self._region(dst.node, dst.id)
        if local is not None and not local.handle:  # VMM: mapped for every device already
            return ptr
        if local is not None:
            handle, base = local.handle, local.region.address - local.offset
        elif dst.keys.cuda is not None:
            handle = dst.keys.cuda.ipc_handle
            base = self.ipc.base_of(handle)
        else:
            return ptr
        mapped = self.ipc.mapped(handle, device)
        return ptr if not mapped else mapped + (ptr - base)

    def resolve(self, prepared: CudaPrepared) -> None:
        epoch = Epoch.value
        requests = prepared.requests
        failed: list[tuple[int, BaseException]] = []
        by_lane: dict[tuple[int, int], list[Copy]] = {}
        pageable: set[tuple[int, int]] = set()  # lanes with a copy from unpinned host memory
        for i, r in enumerate(requests):
            try:
                check_write(r)
                dst_ptr, dst_dev, token, via = self._destination(
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
                dst_region=r.dst.id,
                token=token,
                via=via,
            )
            key = (device, dst_dev)
            by_lane.setdefault(key, []).append(copy)
            if r.src.kind != "gpu" and not self._regions.pinned_at(r.src.id, r.src.address):
                pageable.add(key)
        prepared.epoch, prepared.failed = epoch, failed
        prepared.lanes = [(key, copies.chunks(cs), key in pageable) for key, cs in by_lane.items()]
