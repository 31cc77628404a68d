"""The CUDA driver API, as much of it as weightwire needs, through ctypes on libcuda.

No torch and no Python CUDA package: the daemon opens the CUDA IPC handles that ranks
hand it, copies between GPU regions, and exports dma-bufs for RDMA registration, with
the driver library alone. Every call checks its result and raises `CudaError` naming
the call and the driver's error name. The flag values and structures it passes are
`cudaabi`'s.

The driver's current context is per thread: every thread that calls in must first call
`Driver.use(device)`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass
from typing import Any

from weightwire.protocol.errors import ErrorCode, WeightwireError

from . import cudaabi as abi


class CudaError(WeightwireError):
    code = ErrorCode.TRANSFER


@dataclass(frozen=True)
class Device:
    ordinal: int
    uuid: str  # as nvidia-smi prints it, GPU-xxxxxxxx-...


class Driver:
    """One per process (see `driver()`); loading fails with CudaError where there is no GPU."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self._lib = ctypes.CDLL(name)
        except OSError as exc:
            raise CudaError(f"no CUDA driver library ({name}): {exc}") from None
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        # the calls made once per write, bound with their argument types (no per-call lookups)
        self._memcpy = self._lib.cuMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._memcpy2d = self._lib.cuMemcpy2DAsync_v2
        self._memcpy2d.argtypes = [ctypes.POINTER(abi.Memcpy2D), ctypes.c_void_p]
        self._memcpy2d.restype = ctypes.c_int
        # stream memory operations, V2 (by default since CUDA 11.7; V1 needs a module
        # parameter): None where this driver lacks them
        self._wait32: Any = getattr(self._lib, "cuStreamWaitValue32_v2", None)
        self._write32: Any = getattr(self._lib, "cuStreamWriteValue32_v2", None)
        for fn in (self._wait32, self._write32):
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
        self._call("cuInit", ctypes.c_uint(0))
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        self.devices: list[Device] = []
        for i in range(count.value):
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(i))
            uuid = abi.Uuid()
            self._call("cuDeviceGetUuid", ctypes.byref(uuid), dev)
            self.devices.append(Device(i, abi.uuid_text(bytes(uuid.bytes))))

    # --- plumbing ------------------------------------------------------------

    def _call(self, fn: str, *args: object) -> None:
        rc = getattr(self._lib, fn)(*args)
        if rc != 0:
            raise CudaError(f"{fn} failed: {self.error_name(rc)}")

    def call(self, fn: str, *args: object) -> None:
        """Any driver call by name (ctypes arguments), CudaError naming it if it fails."""
        self._call(fn, *args)

    def try_call(self, fn: str, *args: object) -> int:
        """A driver call whose failure is an answer, not an error: its result code."""
        return int(getattr(self._lib, fn)(*args))

    def error_name(self, rc: int) -> str:
        out = ctypes.c_char_p()
        if self._lib.cuGetErrorName(ctypes.c_int(rc), ctypes.byref(out)) != 0 or not out.value:
            return f"CUDA error {rc}"
        return f"{out.value.decode()} ({rc})"

    def pci_bus_id(self, ordinal: int) -> str:
        """The GPU's PCI address, e.g. `0000:3B:00.0` (for NIC affinity in sysfs)."""
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        buf = ctypes.create_string_buffer(32)
        self._call("cuDeviceGetPCIBusId", buf, ctypes.c_int(len(buf)), dev)
        return buf.value.decode()

    def ordinal_of(self, uuid: str) -> int:
        for d in self.devices:
            if d.uuid == uuid:
                return d.ordinal
        raise CudaError(
            f"GPU {uuid} is not visible to this process (visible: "
            f"{', '.join(d.uuid for d in self.devices) or 'none'}); check CUDA_VISIBLE_DEVICES",
            code=ErrorCode.INVALID,
        )

    def use(self, ordinal: int) -> None:
        """Make `ordinal`'s primary context current in the calling thread."""
        with self._lock:
            ctx = self._ctx.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
                ctx = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
                self._ctx[ordinal] = ctx
        self._call("cuCtxSetCurrent", ctx)

    def enable_peer_access(self) -> list[tuple[int, int]]:
        """Let every device reach every other directly (NVLink/PCIe P2P) where it can.

        Without it, copies between memory of two devices go through the host at a fraction
        of the link's rate. Returns the pairs (from, to) enabled.
        """
        for d in self.devices:
            self.use(d.ordinal)
        enabled = []
        for a in self.devices:
            self.use(a.ordinal)
            for b in self.devices:
                if a.ordinal == b.ordinal:
                    continue
                can = ctypes.c_int(0)
                self._call(
                    "cuDeviceCanAccessPeer",
                    ctypes.byref(can),
                    ctypes.c_int(a.ordinal),
                    ctypes.c_int(b.ordinal),
                )
                if not can.value:
                    continue
                rc = self._lib.cuCtxEnablePeerAccess(self._ctx[b.ordinal], ctypes.c_uint(0))
                if rc not in (0, abi.PEER_ACCESS_ALREADY_ENABLED):
                    raise CudaError(f"cuCtxEnablePeerAccess failed: {self.error_name(rc)}")
                enabled.append((a.ordinal, b.ordinal))
        return enabled

    # --- memory ------------------------------------------------------------------

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that holds device pointer `ptr`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call(
            "cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
        )
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at `base` (not of VMM allocations)."""
        handle = abi.IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(base))
        # not `handle.reserved`: ctypes cuts a c_char array at its first NUL byte
        return ctypes.string_at(ctypes.addressof(handle), abi.IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != abi.IPC_HANDLE_BYTES:
            raise CudaError(
                f"a CUDA IPC handle has {abi.IPC_HANDLE_BYTES} bytes, not {len(handle)}",
                code=ErrorCode.INVALID,
            )
        h = abi.IpcHandle()
        ctypes.memmove(ctypes.byref(h), handle, abi.IPC_HANDLE_BYTES)
        ptr = ctypes.c_uint64()
        flags = ctypes.c_uint(abi.LAZY_ENABLE_PEER_ACCESS)
        self._call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), h, flags)
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def host_alloc(self, nbytes: int) -> tuple[int, memoryview]:
        """Pinned host memory: its address and a writable view of it (free with host_free)."""
        p = ctypes.c_void_p()
        self._call(
            "cuMemHostAlloc",
            ctypes.byref(p),
            ctypes.c_size_t(nbytes),
            ctypes.c_uint(abi.HOST_ALLOC_PORTABLE),
        )
        address = int(p.value or 0)
        return address, memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")

    def host_free(self, address: int) -> None:
        self._call("cuMemFreeHost", ctypes.c_void_p(address))

    def host_register(self, address: int, nbytes: int) -> None:
        """Pin existing host memory (a region's mapping) for fast copies to and from GPUs."""
        self._call(
            "cuMemHostRegister_v2",
            ctypes.c_void_p(address),
            ctypes.c_size_t(nbytes),
            ctypes.c_uint(abi.HOST_REGISTER_PORTABLE),
        )

    def host_unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", ctypes.c_void_p(address))

    def dma_buf_fd(self, ptr: int, nbytes: int) -> int:
        """A dma-buf file descriptor of device memory, for RDMA registration (ibv_reg_dmabuf_mr)."""
        fd = ctypes.c_int(-1)
        self._call(
            "cuMemGetHandleForAddressRange",
            ctypes.byref(fd),
            ctypes.c_uint64(ptr),
            ctypes.c_size_t(nbytes),
            ctypes.c_int(abi.RANGE_HANDLE_DMA_BUF_FD),
            ctypes.c_ulonglong(0),
        )
        return int(fd.value)

    # --- copies, streams and events ----------------------------------------------

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(abi.STREAM_NON_BLOCKING))
        return int(s.value or 0)

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Any direction (unified addressing): device, peer device, or pinned host memory."""
        rc = self._memcpy(dst, src, nbytes, stream)
        if rc != 0:
            raise CudaError(f"cuMemcpyAsync failed: {self.error_name(rc)}")

    def copy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int
    ) -> None:
        """`rows` blocks of `width` bytes, `src_pitch` apart at the source and `dst_pitch`
        at the destination, as one copy (unified addressing, any direction). Pitches above
        `cudaabi.MAX_PITCH` are the caller's to split."""
        p = abi.Memcpy2D(
            srcMemoryType=abi.MEMORYTYPE_UNIFIED,
            srcDevice=src,
            srcPitch=src_pitch,
            dstMemoryType=abi.MEMORYTYPE_UNIFIED,
            dstDevice=dst,
            dstPitch=dst_pitch,
            WidthInBytes=width,
            Height=rows,
        )
        rc = self._memcpy2d(ctypes.byref(p), stream)
        if rc != 0:
            raise CudaError(f"cuMemcpy2DAsync failed: {self.error_name(rc)}")

    def copy_peer_async(
        self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: int
    ) -> None:
        """Device to device across GPUs, naming both contexts (a direct P2P copy once peer
        access is enabled)."""
        self.use(dst_device)
        self.use(src_device)
        self._call(
            "cuMemcpyPeerAsync",
            ctypes.c_uint64(dst),
            self._ctx[dst_device],
            ctypes.c_uint64(src),
            self._ctx[src_device],
            ctypes.c_size_t(nbytes),
            ctypes.c_void_p(stream),
        )

    def event(self) -> int:
        e = ctypes.c_void_p()
        self._call("cuEventCreate", ctypes.byref(e), ctypes.c_uint(abi.EVENT_DISABLE_TIMING))
        return int(e.value or 0)

    def ipc_event(self) -> tuple[int, bytes]:
        """An event another process can wait on (in the current context): the event and
        its IPC handle (64 bytes, for cudaIpcOpenEventHandle / torch's
        `Event.from_ipc_handle`). Destroy it with `destroy_event`."""
        e = ctypes.c_void_p()
        flags = abi.EVENT_INTERPROCESS | abi.EVENT_DISABLE_TIMING
        self._call("cuEventCreate", ctypes.byref(e), ctypes.c_uint(flags))
        event = int(e.value or 0)
        handle = abi.IpcHandle()
        try:
            self._call("cuIpcGetEventHandle", ctypes.byref(handle), ctypes.c_void_p(event))
        except CudaError:
            self.destroy_event(event)
            raise
        # not `handle.reserved`: ctypes cuts a c_char array at its first NUL byte
        return event, ctypes.string_at(ctypes.addressof(handle), abi.IPC_HANDLE_BYTES)

    def record(self, event: int, stream: int) -> None:
        self._call("cuEventRecord", ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def wait_event(self, event: int) -> None:
        """Blocks until the work before the event is done (call it off the event loop)."""
        self._call("cuEventSynchronize", ctypes.c_void_p(event))

    def destroy_event(self, event: int) -> None:
        self._call("cuEventDestroy_v2", ctypes.c_void_p(event))

    def synchronize_all(self) -> None:
        """Wait for all work this process issued, on every device it has used."""
        with self._lock:
            used = list(self._ctx)
        for ordinal in used:
            self.use(ordinal)
            self._call("cuCtxSynchronize")

    def synchronize(self, stream: int) -> None:
        self._call("cuStreamSynchronize", ctypes.c_void_p(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        """`stream`'s later work waits for `event`'s last record (of any context)."""
        self._call("cuStreamWaitEvent", ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)

    # --- stream memory operations (ring slot counters) --------------------------------

    def stream_mem_ops(self) -> bool:
        """Whether 32-bit stream wait/write value operations are there (V2 API)."""
        return self._wait32 is not None and self._write32 is not None

    def wait_value32(self, stream: int, address: int, value: int) -> None:
        """`stream`'s later work waits until the 32-bit word at device address `address`
        is at least `value`, compared cyclically (GEQ): a counter may wrap around."""
        self._value32(
            self._wait32, "cuStreamWaitValue32", stream, address, value, abi.STREAM_WAIT_VALUE_GEQ
        )

    def write_value32(self, stream: int, address: int, value: int) -> None:
        """Once `stream`'s earlier work is done (a memory barrier first), write the 32-bit
        `value` at device address `address`."""
        self._value32(
            self._write32,
            "cuStreamWriteValue32",
            stream,
            address,
            value,
            abi.STREAM_WRITE_VALUE_DEFAULT,
        )

    def _value32(
        self, fn: Any, name: str, stream: int, address: int, value: int, flags: int
    ) -> None:
        if fn is None:
            raise CudaError(f"this CUDA driver has no {name}_v2")
        rc = fn(stream, address, value & 0xFFFFFFFF, flags)
        if rc != 0:
            raise CudaError(f"{name} failed: {self.error_name(rc)}")


_driver: Driver | None = None
_driver_error: CudaError | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's driver (loaded once); CudaError if this machine has no usable GPU."""
    global _driver, _driver_error
    with _driver_lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = Driver()
            except CudaError as exc:
                _driver_error = exc
        if _driver is None:
            assert _driver_error is not None
            raise _driver_error
        return _driver


def available() -> tuple[bool, str]:
    try:
        d = driver()
    except CudaError as exc:
        return False, exc.message
    if not d.devices:
        return False, "the CUDA driver sees no GPU"
    return True, ""
