"""GPU memory of the CUDA virtual memory management (VMM) API, through the driver alone.

SGLang's memory saver (torch_memory_saver) and PyTorch's expandable segments allocate
with `cuMemCreate` + `cuMemMap`; CUDA IPC handles (`cuIpcGetMemHandle`) cannot be taken on
such memory. An allocation created to allow `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
can be exported as a file descriptor, passed to another process over a Unix socket
(`memory.fdpass`) and mapped there; one created without it (torch_memory_saver's
default) cannot be shared at all.

The exporting side: `chunk_at` (is this VMM memory, and what may be done with it),
`export_fd`. The importing side (the daemon): `Imports.open` / `Imports.close`. The
`create` / `release` / `remap` / `destroy` helpers do what torch_memory_saver does, for
tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass

from .cudadrv import CudaError, Driver

HANDLE_TYPE_POSIX_FD = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ALLOCATION_TYPE_PINNED = 0x1
LOCATION_TYPE_DEVICE = 0x1
ACCESS_READWRITE = 0x3
GRANULARITY_MINIMUM = 0x0


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


@dataclass(frozen=True)
class Chunk:
    """One physical allocation (cuMemCreate) mapped at [base, base + size) in this process."""

    base: int
    size: int
    handle_types: int  # the CU_MEM_HANDLE_TYPE_* bits it was created to allow
    device: int  # the ordinal it lives on

    @property
    def posix_fd_ok(self) -> bool:
        return bool(self.handle_types & HANDLE_TYPE_POSIX_FD)


def _prop(device: int, handle_types: int) -> _AllocationProp:
    return _AllocationProp(
        type=ALLOCATION_TYPE_PINNED,
        requestedHandleTypes=handle_types,
        location=_MemLocation(LOCATION_TYPE_DEVICE, device),
    )


def chunk_at(drv: Driver, ptr: int) -> Chunk | None:
    """The VMM allocation mapped at `ptr` (any address in it), or None where `ptr` is not
    VMM memory (cudaMalloc'd: CUDA IPC handles work there). Needs a current context."""
    handle = ctypes.c_ulonglong()
    if drv.try_call("cuMemRetainAllocationHandle", ctypes.byref(handle), ctypes.c_void_p(ptr)):
        return None
    try:
        prop = _AllocationProp()
        drv.call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop), handle)
        base, size = drv.address_range(ptr)
    finally:
        drv.try_call("cuMemRelease", handle)
    return Chunk(base, size, int(prop.requestedHandleTypes), int(prop.location.id))


def chunks_over(drv: Driver, start: int, end: int) -> list[Chunk]:
    """The VMM allocations mapped back to back over [start, end) (expandable segments map
    many into one range); [] where `start` is not VMM memory."""
    found: list[Chunk] = []
    at = start
    while at < end:
        c = chunk_at(drv, at)
        if c is None:
            if found:
                raise CudaError(f"address {at:#x} inside a VMM range has no allocation mapped")
            return []
        found.append(c)
        at = c.base + c.size
    return found


def export_fd(drv: Driver, ptr: int) -> int:
    """A POSIX file descriptor (the caller's to close) of the VMM allocation at `ptr`;
    CudaError where it was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR."""
    handle = ctypes.c_ulonglong()
    drv.call("cuMemRetainAllocationHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
    try:
        fd = ctypes.c_int(-1)
        drv.call(
            "cuMemExportToShareableHandle",
            ctypes.byref(fd),
            handle,
            ctypes.c_int(HANDLE_TYPE_POSIX_FD),
            ctypes.c_ulonglong(0),
        )
    finally:
        drv.try_call("cuMemRelease", handle)
    return int(fd.value)


def grant(drv: Driver, base: int, size: int, device: int) -> None:
    """Read/write access to [base, base + size) for `device`, then for each other device
    that can reach it (its copy engine then writes peer to peer)."""

    def one(ordinal: int) -> None:
        desc = _AccessDesc(_MemLocation(LOCATION_TYPE_DEVICE, ordinal), ACCESS_READWRITE)
        drv.call(
            "cuMemSetAccess",
            ctypes.c_uint64(base),
            ctypes.c_size_t(size),
            ctypes.byref(desc),
            ctypes.c_size_t(1),
        )

    one(device)
    for d in drv.devices:
        if d.ordinal == device:
            continue
        can = ctypes.c_int(0)
        drv.try_call(
            "cuDeviceCanAccessPeer",
            ctypes.byref(can),
            ctypes.c_int(d.ordinal),
            ctypes.c_int(device),
        )
        if can.value:
            with contextlib.suppress(CudaError):  # it copies through unified addressing instead
                one(d.ordinal)


@dataclass(frozen=True)
class Mapping:
    base: int
    size: int
    handles: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]  # (address, size) of each mapped allocation


class Imports:
    """Allocations of other processes mapped here from their fds, by base address."""

    def __init__(self, drv: Driver) -> None:
        self._drv = drv
        self._lock = threading.Lock()
        self._maps: dict[int, Mapping] = {}

    def open(self, fds: list[int], sizes: list[int], device: int) -> int:
        """Map the allocations behind `fds` (`sizes` bytes each) one after another into a
        fresh address range, accessible from `device` (current context) and its peers: its
        base. The fds stay the caller's to close (the driver holds its own references)."""
        drv = self._drv
        total = sum(sizes)
        ptr = ctypes.c_uint64()
        drv.call(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(total),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_ulonglong(0),
        )
        base = int(ptr.value)
        handles: list[int] = []
        ranges: list[tuple[int, int]] = []
        try:
            at = base
            for fd, size in zip(fds, sizes, strict=True):
                handle = ctypes.c_ulonglong()
                drv.call(
                    "cuMemImportFromShareableHandle",
                    ctypes.byref(handle),
                    ctypes.c_void_p(fd),
                    ctypes.c_int(HANDLE_TYPE_POSIX_FD),
                )
                handles.append(int(handle.value))
                drv.call(
                    "cuMemMap",
                    ctypes.c_uint64(at),
                    ctypes.c_size_t(size),
                    ctypes.c_size_t(0),
                    handle,
                    ctypes.c_ulonglong(0),
                )
                ranges.append((at, size))
                at += size
            grant(drv, base, total, device)
        except BaseException:
            _unmap(drv, Mapping(base, total, tuple(handles), tuple(ranges)))
            raise
        with self._lock:
            self._maps[base] = Mapping(base, total, tuple(handles), tuple(ranges))
        return base

    def close(self, base: int) -> None:
        """Unmap what `open` mapped at `base`, and drop this process's references to it:
        the owner's release then gives the GPU memory back."""
        with self._lock:
            found = self._maps.pop(base, None)
        if found is not None:
            _unmap(self._drv, found)

    def close_all(self) -> None:
        with self._lock:
            bases = list(self._maps)
        for base in bases:
            self.close(base)


def _unmap(drv: Driver, m: Mapping) -> None:
    errors = []
    for at, size in m.ranges:
        if rc := drv.try_call("cuMemUnmap", ctypes.c_uint64(at), ctypes.c_size_t(size)):
            errors.append(f"cuMemUnmap: {drv.error_name(rc)}")
    for h in m.handles:
        if rc := drv.try_call("cuMemRelease", ctypes.c_ulonglong(h)):
            errors.append(f"cuMemRelease: {drv.error_name(rc)}")
    if rc := drv.try_call("cuMemAddressFree", ctypes.c_uint64(m.base), ctypes.c_size_t(m.size)):
        errors.append(f"cuMemAddressFree: {drv.error_name(rc)}")
    if errors:
        raise CudaError("; ".join(errors))


# --- what torch_memory_saver does, for tests ---------------------------------------


@dataclass
class Owned:
    """A cuMemCreate allocation this process made and mapped (`create`)."""

    base: int
    size: int
    device: int
    handle_types: int
    handle: int = 0  # 0 while released


def create(drv: Driver, nbytes: int, device: int, handle_types: int) -> Owned:
    """At least `nbytes` on `device` (current context), mapped and writable there,
    allowing `handle_types` (0: no shareable handle, as torch_memory_saver makes them)."""
    prop = _prop(device, handle_types)
    gran = ctypes.c_size_t()
    drv.call(
        "cuMemGetAllocationGranularity",
        ctypes.byref(gran),
        ctypes.byref(prop),
        ctypes.c_int(GRANULARITY_MINIMUM),
    )
    size = -(-nbytes // gran.value) * gran.value
    ptr = ctypes.c_uint64()
    drv.call(
        "cuMemAddressReserve",
        ctypes.byref(ptr),
        ctypes.c_size_t(size),
        ctypes.c_size_t(0),
        ctypes.c_uint64(0),
        ctypes.c_ulonglong(0),
    )
    owned = Owned(int(ptr.value), size, device, handle_types)
    remap(drv, owned)
    return owned


def release(drv: Driver, owned: Owned) -> None:
    """Unmap and release the physical memory, keeping the address range (pause)."""
    drv.call("cuMemUnmap", ctypes.c_uint64(owned.base), ctypes.c_size_t(owned.size))
    drv.call("cuMemRelease", ctypes.c_ulonglong(owned.handle))
    owned.handle = 0


def remap(drv: Driver, owned: Owned) -> None:
    """Back the (unmapped) range with a fresh allocation (resume)."""
    handle = ctypes.c_ulonglong()
    prop = _prop(owned.device, owned.handle_types)
    drv.call(
        "cuMemCreate",
        ctypes.byref(handle),
        ctypes.c_size_t(owned.size),
        ctypes.byref(prop),
        ctypes.c_ulonglong(0),
    )
    drv.call(
        "cuMemMap",
        ctypes.c_uint64(owned.base),
        ctypes.c_size_t(owned.size),
        ctypes.c_size_t(0),
        handle,
        ctypes.c_ulonglong(0),
    )
    owned.handle = int(handle.value)
    grant(drv, owned.base, owned.size, owned.device)


def destroy(drv: Driver, owned: Owned) -> None:
    if owned.handle:
        release(drv, owned)
    drv.call("cuMemAddressFree", ctypes.c_uint64(owned.base), ctypes.c_size_t(owned.size))
