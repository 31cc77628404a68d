"""The cuda transport's regions: GPU regions by CUDA IPC handle (or VMM memory the daemon
mapped), host regions pinned once for faster copies out of them."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import structlog

from weightwire.memory.cudadrv import CudaError, Driver
from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError
from weightwire.protocol.regions import CudaKey, RegionKeys
from weightwire.transport.base import LocalRegion
from weightwire.transport.removed import RemovedRegions, unknown

from .inflight import REGIONS
from .prepared import Epoch

log = structlog.get_logger("weightwire.transport.cuda")


@dataclass(frozen=True, slots=True)
class Local:
    region: LocalRegion
    handle: bytes  # its CUDA IPC handle; empty for VMM memory (mapped for every device)
    offset: int  # where the region starts in the handle's allocation
    token: int = 0  # this registration's (`inflight.REGIONS`): copies resolved against it


class CudaRegions:
    """Regions registered with one cuda transport; every change bumps `Epoch` (prepared
    writes resolve again)."""

    def __init__(self, node: str, host: str) -> None:
        self.node, self.host = node, host
        self._local: dict[int, Local] = {}
        self.pinned: dict[int, int] = {}  # host regions pinned here: id -> address
        self._removed = RemovedRegions()  # a write into one: peer_lost, not unknown_region
        self._lock = threading.Lock()  # registration runs on worker threads in the daemon
        self._leaving: dict[int, bytes] = {}  # deregistered, not drained yet: their handle

    def get(self, region_id: int) -> Local | None:
        return self._local.get(region_id)

    def missing(self, region_id: int, node: str) -> RegionError | PeerLostError:
        """The refusal of a write into region `region_id` (of `node`), not registered here:
        peer_lost (retryable) when it was deregistered, unknown_region when it never was."""
        with self._lock:
            return unknown(region_id, self._removed, f" of {node}")

    def close(self) -> None:
        """The transport closed (its lanes done): its registrations leave `REGIONS`."""
        with self._lock:
            ids = list(self._local)
        for region_id in ids:
            REGIONS.deregister((self.node, region_id))

    def drained(self, region_id: int) -> bytes:
        """A deregistered region no longer written: its IPC handle if no other region of
        this transport (registered, or leaving) is in the same allocation, else b""."""
        with self._lock:
            handle = self._leaving.pop(region_id, b"")
            others = [local.handle for local in self._local.values()]
            if handle in others or handle in self._leaving.values():
                return b""
        return handle

    def pinned_at(self, region_id: int, address: int) -> bool:
        """Whether host region `region_id` is pinned, at `address`."""
        return self.pinned.get(region_id) == address

    def register(self, drv: Driver | None, region: LocalRegion) -> RegionKeys:
        if region.kind != "gpu":
            # host regions are only read (a CPU replica copied to a GPU): pin them for speed
            assert drv is not None
            if region.address and not self.pinned_at(region.id, region.address):
                try:
                    drv.use(drv.devices[0].ordinal)  # any context will do
                    drv.host_register(region.address, region.length)
                    self.pinned[region.id] = region.address
                    Epoch.bump()
                except CudaError as exc:
                    log.warning(
                        "host region not pinned; copies from it go through a thread",
                        region=region.id,
                        error=exc.message,
                    )
            return RegionKeys()
        offset = region.extra.get("ipc_offset", 0)
        uuid = region.extra.get("device_uuid")
        if isinstance(region.extra.get("vmm_base"), int) and isinstance(offset, int):
            # VMM memory the daemon mapped from the rank's fds, reachable by every device:
            # written here, by this daemon's lanes; no key another process could open
            self._add(region, b"", offset)
            return RegionKeys()
        handle = region.extra.get("ipc_handle")
        if (
            not isinstance(handle, bytes)
            or not isinstance(offset, int)
            or not isinstance(uuid, str)
        ):
            raise RegionError(
                f"gpu region {region.id} has no CUDA IPC handle", code=ErrorCode.INVALID
            )
        self._add(region, handle, offset)
        return RegionKeys(
            cuda=CudaKey(host_id=self.host, device_uuid=uuid, ipc_handle=handle, offset=offset)
        )

    def _add(self, region: LocalRegion, handle: bytes, offset: int) -> None:
        token = REGIONS.register((self.node, region.id))  # copies resolved before: refused
        with self._lock:
            self._local[region.id] = Local(region, handle, offset, token)
            self._removed.discard(region.id)  # registered again (a remap keeps its id)
            self._leaving.pop(region.id, None)
        Epoch.bump()

    def deregister(self, drv: Driver | None, region_id: int) -> None:
        with self._lock:
            local = self._local.pop(region_id, None)
            if local is not None:
                self._removed.add(region_id)
                if local.handle:
                    self._leaving[region_id] = local.handle
        REGIONS.deregister((self.node, region_id))  # copies queued into it are refused
        address = self.pinned.pop(region_id, None)
        Epoch.bump()
        if address is not None and drv is not None:
            with contextlib.suppress(CudaError):
                drv.host_unregister(address)
