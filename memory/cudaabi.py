"""The CUDA driver's C ABI as weightwire calls it through ctypes: the flag values and the
structures of `cuda.h` that `cudadrv.Driver` passes (no calls here)."""

from __future__ import annotations

import ctypes

IPC_HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 0x1
STREAM_NON_BLOCKING = 0x1
EVENT_DISABLE_TIMING = 0x2
EVENT_INTERPROCESS = 0x4  # CU_EVENT_INTERPROCESS: needs EVENT_DISABLE_TIMING too
HOST_REGISTER_PORTABLE = 0x1
HOST_ALLOC_PORTABLE = 0x1
RANGE_HANDLE_DMA_BUF_FD = 0x1
PEER_ACCESS_ALREADY_ENABLED = 704
MEMORYTYPE_UNIFIED = 4
MAX_PITCH = (1 << 31) - 1  # cuMemcpy2D's limit on a row pitch (CU_DEVICE_ATTRIBUTE_MAX_PITCH)
STREAM_WAIT_VALUE_GEQ = 0x0  # (int32_t)(*addr - value) >= 0: cyclic, wraparound ignored
STREAM_WRITE_VALUE_DEFAULT = 0x0  # a memory barrier first: earlier work's accesses are done


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (v2)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


def uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
