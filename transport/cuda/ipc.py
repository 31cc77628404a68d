"""Other processes' GPU allocations, opened by their CUDA IPC handles once each: in the
owning device's context, and in each copying device's context (a peer mapping, so that
its copy engine writes across NVLink)."""

from __future__ import annotations

import contextlib
import threading

import structlog

from weightwire.memory.cudadrv import CudaError, Driver

log = structlog.get_logger("weightwire.transport.cuda")


class IpcMaps:
    def __init__(self, drv: Driver) -> None:
        self._drv = drv
        self._lock = threading.Lock()
        self._opened: dict[bytes, tuple[int, int]] = {}  # handle -> (base, size) on its device
        self._mapped: dict[tuple[bytes, int], int] = {}  # (handle, device) -> base there; 0: none

    def opened(self, handle: bytes, device: int) -> tuple[int, int]:
        """(base, size) of the allocation behind `handle`, which lives on `device`."""
        with self._lock:
            found = self._opened.get(handle)
            if found is None:
                self._drv.use(device)
                base = self._drv.ipc_open(handle)
                found = self._opened[handle] = (base, self._drv.address_range(base)[1])
        return found

    def base_of(self, handle: bytes) -> int:
        return self._opened[handle][0]

    def mapped(self, handle: bytes, device: int) -> int:
        """The allocation's base as `device` sees it, or 0 where it cannot be mapped."""
        key = (handle, device)
        with self._lock:
            found = self._mapped.get(key)
            if found is None:
                try:
                    self._drv.use(device)
                    found = self._mapped[key] = self._drv.ipc_open(handle)
                except CudaError as exc:  # e.g. the same process exported it: keep the plain copy
                    log.info(
                        "no peer mapping; copying through unified addressing", error=exc.message
                    )
                    found = self._mapped[key] = 0
        return found

    def held(self) -> int:
        """Allocations (by handle) with a mapping open here: opened, or per device."""
        with self._lock:
            return len({*self._opened, *(h for (h, _), b in self._mapped.items() if b)})

    def forget(self, handle: bytes) -> None:
        """Close every mapping of `handle` made here: its allocation is no longer written
        (an importer's mapping must be closed before the owner frees the memory)."""
        with self._lock:
            bases = [b for k, b in self._mapped.items() if k[0] == handle]
            self._mapped = {k: b for k, b in self._mapped.items() if k[0] != handle}
            opened = self._opened.pop(handle, None)
        if opened is not None:
            bases.append(opened[0])
        for base in bases:
            if base:
                with contextlib.suppress(CudaError):
                    self._drv.ipc_close(base)

    def close(self) -> None:
        with self._lock:
            bases = [*(b for b, _ in self._opened.values()), *self._mapped.values()]
            self._opened.clear()
            self._mapped.clear()
        for base in bases:
            if base:
                with contextlib.suppress(CudaError):
                    self._drv.ipc_close(base)
