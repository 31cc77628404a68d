"""Memory registration: which NICs a region's lanes are (a GPU's affine NICs, or the host
NICs), and pinning it once on each of them (host memory by address, GPU memory by
dma-buf). The keys (device, address, rkey) go to peers inside the region's descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from typing import Any

import structlog

from weightwire.memory.hostmem import address_of, page_span
from weightwire.protocol.errors import RegistrationError, WeightwireError
from weightwire.protocol.regions import RegionKeys, VerbsKey
from weightwire.transport.base import LocalRegion
from weightwire.transport.removed import RemovedRegions

from .devices import affine_nics, pci_path_of_bus_id, pci_path_of_nic
from .hw import populate
from .ibv import errno_of
from .runtime import Runtime

log = structlog.get_logger("weightwire.transport.verbs")


@dataclass(eq=False)
class Registered:
    region: LocalRegion
    devices: list[str]  # its lanes, in order
    mrs: dict[str, Any]
    base: int  # the address of byte 0 in the MRs' address space (virtual, or dma-buf offset)
    keys: dict[str, VerbsKey]
    dmabuf_fd: int | None = None  # exported here, closed at deregistration


class Regions:
    """The regions registered here, by id."""

    def __init__(
        self,
        rt: Runtime,
        *,
        nics_per_gpu: int,
        host_nics: int,
        relaxed_ordering: bool,
        sysfs: str,
    ) -> None:
        self.rt = rt
        self.nics_per_gpu = nics_per_gpu
        self.host_nics = host_nics
        self.relaxed_ordering = relaxed_ordering
        self.sysfs = sysfs
        self._regions: dict[int, Registered] = {}
        self.removed = RemovedRegions()  # a Check of one: peer_lost, not unknown_region
        self._gpu_nics: dict[str, list[str]] = {}

    def get(self, region_id: int) -> Registered | None:
        return self._regions.get(region_id)

    def __contains__(self, region_id: int) -> bool:
        return region_id in self._regions

    # --- lanes -------------------------------------------------------------------

    def _host_devices(self) -> list[str]:
        order = self.rt.order
        n = self.host_nics if self.host_nics > 0 else len(order)
        return order[: max(1, min(n, len(order)))]

    def _gpu_devices(self, uuid: str) -> list[str]:
        cached = self._gpu_nics.get(uuid)
        if cached is not None:
            return cached
        try:
            from weightwire.memory.cudadrv import driver

            drv = driver()
            gpu_path = pci_path_of_bus_id(drv.pci_bus_id(drv.ordinal_of(uuid)), self.sysfs)
            nics = affine_nics(gpu_path, {n: pci_path_of_nic(n, self.sysfs) for n in self.rt.order})
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

    # --- registration ------------------------------------------------------------

    def register(self, region: LocalRegion) -> RegionKeys:
        """Pin the region on each NIC of its lanes (on a worker thread in the daemon)."""
        rt = self.rt
        if not rt.devs or rt.closed:
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
        with rt.working():
            try:
                if region.kind == "cpu":
                    populate(base, region.length)  # once, before the first MR pins the pages
                for name in devices:
                    dev = rt.devs[name]
                    if region.kind == "cpu":
                        mrs[name] = dev.register(base, region.length, self.relaxed_ordering)
                    else:
                        mrs[name] = dev.register_dmabuf(
                            fd, base, region.length, self.relaxed_ordering
                        )
            except rt.api.Error as exc:
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
        keys = {
            name: VerbsKey(device=name, addr=base, rkey=int(mr.rkey)) for name, mr in mrs.items()
        }
        reg = Registered(region, devices, mrs, base, keys, owned_fd)
        with rt.lock:
            old = self._regions.pop(region.id, None)
            self._regions[region.id] = reg
            self.removed.discard(region.id)
            rt.stats["regions"] = len(self._regions)
        if old is not None:
            self._release(old)
        return RegionKeys(verbs=tuple(keys[n] for n in devices))

    def _dmabuf(self, region: LocalRegion) -> tuple[int, int, int | None]:
        """(fd, offset of byte 0 in it, fd to close later) for GPU memory: the dma-buf the
        rank handed over, or one exported here through the CUDA driver."""
        if region.fd is not None:
            offset = region.extra.get("dmabuf_offset", 0)
            return region.fd, int(offset) if isinstance(offset, int) else 0, None
        from weightwire.memory.cudadrv import driver

        drv = driver()
        if region.device is not None:
            drv.use(region.device)
        start, span = page_span(region.address, region.length)
        fd = drv.dma_buf_fd(start, span)
        return fd, region.address - start, fd

    def deregister(self, region_id: int) -> None:
        with self.rt.lock:
            reg = self._regions.pop(region_id, None)
            if reg is not None:
                self.removed.add(region_id)
            self.rt.stats["regions"] = len(self._regions)
        if reg is not None:
            self._release(reg)

    def close(self) -> None:
        """Release every region (the transport is closing)."""
        with self.rt.lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for reg in regions:
            self._release(reg)

    def _release(self, reg: Registered) -> None:
        for mr in reg.mrs.values():
            with contextlib.suppress(Exception):
                mr.close()
        if reg.dmabuf_fd is not None:
            with contextlib.suppress(OSError):
                os.close(reg.dmabuf_fd)
