"""The node's regions: rank memory mapped once, registered once with every transport."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from weightwire.memory.hostmem import SHM_DIR, SharedFile, open_shared
from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import CudaRegion
from weightwire.protocol.regions import RegionDescriptor, RegionKeys
from weightwire.transport.base import LocalRegion, Transport

log = structlog.get_logger("weightwire.daemon.regions")

# How long a gpu region's mapping is kept after it left the transports, for the copies
# already issued into it to finish (a cuda lane's, `transport/cuda/inflight.py`); past it,
# it is unmapped all the same (an error line): a rank's memory is not held for ever.
UNMAP_WAIT_S = 10.0


@dataclass(eq=False)
class Region:
    local: LocalRegion
    descriptor: RegionDescriptor
    purpose: str
    session: str
    file: SharedFile | None = None
    released: bool = False  # gpu memory its rank released (RemapRegion): no mapping here


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
    # the descriptors a rank passed under a token (the local server's fd inbox)
    claim_fds: Callable[[bytes], list[int]] | None = None
    _vmm: Any = None  # memory.vmm.Imports, made on first use
    # gpu regions removed while copies into them were in flight: unmapped by `reap` once
    # done, or at the deadline (monotonic)
    _draining: list[tuple[LocalRegion, float]] = field(default_factory=list)

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
        """GPU memory of a rank: through its CUDA IPC handle (opened once per allocation),
        or VMM memory through the fds it passed (`CudaRegion.vmm_token`)."""
        local = self._map_cuda(info, length, self._next_id(), owner)
        try:
            keys = self._register(local)
        except BaseException:
            self._unmap(local)
            raise
        return self._store(local, keys, purpose, session, kind="gpu", device=info.device_uuid)

    def _map_cuda(self, info: CudaRegion, length: int, region_id: int, owner: str) -> LocalRegion:
        from weightwire.memory.cudadrv import driver

        drv = driver()
        ordinal = drv.ordinal_of(info.device_uuid)
        drv.use(ordinal)
        extra: dict[str, object] = {"ipc_offset": info.offset, "device_uuid": info.device_uuid}
        if info.vmm_sizes:
            base = self._import_vmm(info, ordinal)
            size = sum(info.vmm_sizes)
            extra["vmm_base"] = base
        else:
            if info.vmm_token:
                raise RegistrationError("a vmm_token without vmm_sizes", code=ErrorCode.INVALID)
            with self._lock:
                base, refs = self._ipc.get(info.ipc_handle, (0, 0))
                if not refs:
                    base = drv.ipc_open(info.ipc_handle)
                self._ipc[info.ipc_handle] = (base, refs + 1)
            extra["ipc_handle"] = info.ipc_handle
            try:
                _, size = drv.address_range(base)
            except BaseException:
                self._release_ipc(info.ipc_handle)
                raise
        local = LocalRegion(
            id=region_id,
            kind="gpu",
            length=length,
            address=base + info.offset,
            device=ordinal,
            owner=owner,
            extra=extra,
        )
        if info.offset + length > size:
            self._unmap(local)
            raise RegistrationError(
                f"GPU region of {length} bytes at offset {info.offset} overruns its "
                f"{size}-byte allocation",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        return local

    def _import_vmm(self, info: CudaRegion, ordinal: int) -> int:
        """Map the VMM allocations the rank passed as fds; their base here."""
        from weightwire.memory import vmm
        from weightwire.memory.cudadrv import CudaError, driver
        from weightwire.memory.fdpass import FdPassError

        if self.claim_fds is None:
            raise RegistrationError(
                "this daemon takes no file descriptors (no fd socket)", code=ErrorCode.INVALID
            )
        try:
            fds = self.claim_fds(info.vmm_token)
        except FdPassError as exc:
            raise RegistrationError(f"VMM region: {exc}", code=ErrorCode.INVALID) from None
        try:
            if len(fds) != len(info.vmm_sizes):
                raise RegistrationError(
                    f"VMM region of {len(info.vmm_sizes)} allocations came with {len(fds)} "
                    "file descriptors",
                    code=ErrorCode.INVALID,
                )
            with self._lock:
                if self._vmm is None:
                    self._vmm = vmm.Imports(driver())
                imports = self._vmm
            try:
                return int(imports.open(fds, list(info.vmm_sizes), ordinal))
            except CudaError as exc:
                raise RegistrationError(
                    f"could not map the rank's VMM memory: {exc.message}", code=ErrorCode.INVALID
                ) from None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _unmap(self, local: LocalRegion) -> None:
        """Drop this daemon's mapping of a gpu region's memory."""
        from weightwire.memory.cudadrv import CudaError

        handle = local.extra.get("ipc_handle")
        if isinstance(handle, bytes):
            self._release_ipc(handle)
        base = local.extra.get("vmm_base")
        if isinstance(base, int) and self._vmm is not None:
            try:
                self._vmm.close(base)
            except CudaError as exc:
                log.warning("could not unmap VMM memory", region=local.id, error=exc.message)
            local.extra.pop("vmm_base", None)

    def detach(self, region_id: int, session: str) -> Region:
        """First half of a remap, on the loop: the rank's gpu region leaves every
        transport, so that no copy into it is issued from now on (writes into it fail)."""
        region = self.regions.get(region_id)
        if region is None or region.session != session or region.local.kind != "gpu":
            raise RegistrationError(
                f"region {region_id} is not a GPU region this rank registered",
                code=ErrorCode.UNKNOWN_REGION,
            )
        if not region.released:
            for t in self.transports:
                t.deregister(region_id)
        return region

    def remap_cuda(self, region: Region, info: CudaRegion | None) -> None:
        """Second half, off the loop: once the copies already issued are done, drop the old
        mapping (the rank's release then frees the GPU memory), and map the new memory
        (`info`; None: none until the next remap) under the same id, with new keys."""
        from weightwire.memory.cudadrv import driver

        old = region.local
        if not region.released:
            # copies issued before `detach` may still be running: the transports' (bounded:
            # cuda lanes' copies, tcp writes going through a bounce), then the device's
            if self._drained(old.id, UNMAP_WAIT_S):
                driver().synchronize_all()
            else:
                log.error(
                    "copies into a released region still in flight: unmapped all the same",
                    region=old.id,
                    waited_s=UNMAP_WAIT_S,
                )
            self._unmap(old)
            region.released = True
        if info is None:
            # its CUDA key opens memory that is no more: advertised without it, so that a
            # daemon of this host that opened it lets it go (`transport/cuda/remote.py`)
            if region.descriptor.keys.cuda is not None:
                keys = msgspec.structs.replace(region.descriptor.keys, cuda=None)
                region.descriptor = msgspec.structs.replace(region.descriptor, keys=keys)
            log.info("region released by its rank", region=old.id, owner=old.owner)
            return
        local = self._map_cuda(info, old.length, old.id, old.owner)
        if region.descriptor.keys.tcp is not None:  # writers elsewhere keep their key
            local.extra["tcp_rkey"] = region.descriptor.keys.tcp.rkey
        try:
            keys = self._register(local)
        except BaseException:
            self._unmap(local)
            raise
        region.local = local
        region.released = False
        region.descriptor = RegionDescriptor(
            id=old.id, node=self.node, kind="gpu", length=old.length, keys=keys
        )
        log.info("region remapped", region=old.id, owner=old.owner, vmm=bool(info.vmm_sizes))

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
        if not region.released:
            for t in self.transports:
                t.deregister(region_id)
        if region.file is not None:
            self._closing.append(region.file)
        if region.local.kind == "gpu" and not region.released:  # once no copy is into it
            self._draining.append((region.local, time.monotonic() + UNMAP_WAIT_S))
        self.reap()
        log.info("region released", region=region_id, owner=region.local.owner)

    def reap(self, force: bool = False) -> None:
        """Unmap released regions once no receive is still writing into them (on the
        loop: nothing waits). `force`: every gpu region now (the transports are closed)."""
        self._closing = [f for f in self._closing if not f.close()]
        now, waiting = time.monotonic(), []
        for local, deadline in self._draining:
            if force or self._drained(local.id, 0.0):
                self._unmap(local)
            elif now >= deadline:
                log.error(
                    "copies into a removed region still in flight: unmapped all the same",
                    region=local.id,
                    waited_s=UNMAP_WAIT_S,
                )
                self._unmap(local)
            else:
                waiting.append((local, deadline))
        self._draining = waiting

    def _drained(self, region_id: int, timeout_s: float) -> bool:
        """Whether no transport may still be writing into a deregistered region, waiting
        up to `timeout_s` in all (0: answer at once)."""
        deadline = time.monotonic() + timeout_s
        return all(
            t.drained(region_id, max(0.0, deadline - time.monotonic())) for t in self.transports
        )

    def of_session(self, session: str) -> list[Region]:
        return [r for r in self.regions.values() if r.session == session]

    def close(self) -> None:
        for region_id in list(self.regions):
            self.remove(region_id)
        self.reap(force=True)
        if self._vmm is not None:
            self._vmm.close_all()
