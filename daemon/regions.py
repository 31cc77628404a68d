"""The node's regions: rank memory mapped once, registered once with every transport."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import structlog

from weightwire.memory.hostmem import SHM_DIR, SharedFile, open_shared
from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import CudaRegion
from weightwire.protocol.regions import RegionDescriptor, RegionKeys
from weightwire.transport.base import LocalRegion, Transport

log = structlog.get_logger("weightwire.daemon.regions")


@dataclass(eq=False)
class Region:
    local: LocalRegion
    descriptor: RegionDescriptor
    purpose: str
    session: str
    file: SharedFile | None = None


@dataclass
class RegionRegistry:
    node: str
    transports: list[Transport]
    directory: str = SHM_DIR  # where rank region files must live
    regions: dict[int, Region] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _closing: list[SharedFile] = field(default_factory=list)
    _ipc: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # handle -> (base, refs)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # adds run on worker threads

    def add_shared(self, path: str, length: int, purpose: str, session: str, owner: str) -> Region:
        file = open_shared(path, length, self.directory)
        local = LocalRegion(
            id=self._next_id(),
            kind="cpu",
            length=length,
            view=file.view,
            fd=file.fd,
            address=file.address,
            owner=owner,
        )
        try:
            keys = self._register(local)
        except BaseException:
            file.close()
            raise
        return self._store(local, keys, purpose, session, file)

    def add_cuda(
        self, info: CudaRegion, length: int, purpose: str, session: str, owner: str
    ) -> Region:
        """GPU memory of a rank, through its CUDA IPC handle (opened once per allocation)."""
        from weightwire.memory.cudadrv import driver

        drv = driver()
        ordinal = drv.ordinal_of(info.device_uuid)
        drv.use(ordinal)
        with self._lock:
            base, refs = self._ipc.get(info.ipc_handle, (0, 0))
            if not refs:
                base = drv.ipc_open(info.ipc_handle)
            self._ipc[info.ipc_handle] = (base, refs + 1)
        try:
            _, size = drv.address_range(base)
            if info.offset + length > size:
                raise RegistrationError(
                    f"GPU region of {length} bytes at offset {info.offset} overruns its "
                    f"{size}-byte allocation",
                    code=ErrorCode.OUT_OF_BOUNDS,
                )
            local = LocalRegion(
                id=self._next_id(),
                kind="gpu",
                length=length,
                address=base + info.offset,
                device=ordinal,
                owner=owner,
                extra={
                    "ipc_handle": info.ipc_handle,
                    "ipc_offset": info.offset,
                    "device_uuid": info.device_uuid,
                },
            )
            keys = self._register(local)
        except BaseException:
            self._release_ipc(info.ipc_handle)
            raise
        return self._store(local, keys, purpose, session, kind="gpu", device=info.device_uuid)

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _store(
        self,
        local: LocalRegion,
        keys: RegionKeys,
        purpose: str,
        session: str,
        file: SharedFile | None = None,
        **log_fields: str,
    ) -> Region:
        region = Region(
            local=local,
            descriptor=RegionDescriptor(
                id=local.id, node=self.node, kind=local.kind, length=local.length, keys=keys
            ),
            purpose=purpose,
            session=session,
            file=file,
        )
        self.regions[local.id] = region
        log.info(
            "region registered",
            region=local.id,
            bytes=local.length,
            purpose=purpose,
            owner=local.owner,
            **log_fields,
        )
        return region

    def _release_ipc(self, handle: bytes) -> None:
        from weightwire.memory.cudadrv import CudaError, driver

        with self._lock:
            base, refs = self._ipc.pop(handle, (0, 0))
            if refs > 1:
                self._ipc[handle] = (base, refs - 1)
        if refs == 1:
            try:
                driver().ipc_close(base)
            except CudaError as exc:
                log.warning("could not close a CUDA IPC mapping", error=exc.message)

    def _register(self, local: LocalRegion) -> RegionKeys:
        merged = RegionKeys()
        done: list[Transport] = []
        try:
            for t in self.transports:
                keys = t.register(local)
                done.append(t)
                merged = RegionKeys(
                    tcp=keys.tcp or merged.tcp,
                    verbs=merged.verbs + keys.verbs,
                    cuda=keys.cuda or merged.cuda,
                )
        except BaseException:
            for t in done:
                t.deregister(local.id)
            raise
        return merged

    def remove(self, region_id: int) -> None:
        region = self.regions.pop(region_id, None)
        if region is None:
            return
        for t in self.transports:
            t.deregister(region_id)
        if region.file is not None:
            self._closing.append(region.file)
        handle = region.local.extra.get("ipc_handle")
        if isinstance(handle, bytes):
            self._release_ipc(handle)
        self.reap()
        log.info("region released", region=region_id, owner=region.local.owner)

    def reap(self) -> None:
        """Unmap released regions once no receive is still writing into them."""
        self._closing = [f for f in self._closing if not f.close()]

    def of_session(self, session: str) -> list[Region]:
        return [r for r in self.regions.values() if r.session == session]

    def close(self) -> None:
        for region_id in list(self.regions):
            self.remove(region_id)
