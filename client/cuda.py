"""What the daemon needs to reach a rank's GPU memory: the CUDA IPC handle of the
allocation holding it, and the offset into that allocation."""

from __future__ import annotations

import torch

from weightwire.memory.cudadrv import CudaError, driver
from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import CudaRegion

EXPORTED: dict[bytes, int] = {}
"""IPC handles this process made (for its own allocations) -> the allocation's base: a
handle cannot be opened by the process that exported it, whose pointer is valid as it is."""


def allocation_of(t: torch.Tensor) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding tensor `t`."""
    drv = driver()
    drv.use(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return drv.address_range(t.data_ptr())


def region_of(t: torch.Tensor, base: int | None = None) -> CudaRegion:
    """The CudaRegion starting at `base` (default: at `t` itself) of t's allocation."""
    drv = driver()
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    drv.use(device)
    alloc, _ = drv.address_range(t.data_ptr())
    try:
        handle = drv.ipc_handle(alloc)
    except CudaError as exc:
        raise RegistrationError(
            f"cannot share GPU memory of this tensor through CUDA IPC ({exc.message}); "
            "allocations made by expandable segments (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True) cannot be, plain cudaMalloc ones can",
            code=ErrorCode.INVALID,
        ) from None
    EXPORTED[handle] = alloc
    start = t.data_ptr() if base is None else base
    return CudaRegion(device_uuid=drv.devices[device].uuid, ipc_handle=handle, offset=start - alloc)


def gpu_uuid(device: int | None) -> str:
    """The UUID of CUDA device `device` (as the daemon knows it); "" for None."""
    if device is None:
        return ""
    return driver().devices[device].uuid
