"""What the daemon needs to reach a rank's GPU memory: the CUDA IPC handle of the
allocation holding it (cudaMalloc'd memory), or, for CUDA VMM memory (cuMemCreate:
SGLang's memory saver, PyTorch's expandable segments), its allocations exported as POSIX
file descriptors and passed to the daemon's fd socket; and where the region starts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import TypeVar

import torch

from weightwire.memory import fdpass, vmm
from weightwire.memory.cudadrv import CudaError, driver
from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import CudaRegion

T = TypeVar("T")

EXPORTED: dict[bytes, int] = {}
"""IPC handles this process made (for its own allocations) -> the allocation's base: a
handle cannot be opened by the process that exported it, whose pointer is valid as it is."""

NOT_SHAREABLE = (
    "cannot register {what}: its GPU memory is a CUDA VMM allocation (cuMemCreate) made "
    "without a shareable handle type, so no other process can map it. SGLang's "
    "--enable-memory-saver (torch_memory_saver, which has no option to request one) "
    "allocates weights this way. Start SGLang without --enable-memory-saver (with or "
    "without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: both work), or allocate "
    "the weights with requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
)


def _device(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def allocation_of(t: torch.Tensor) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding tensor `t`."""
    drv = driver()
    drv.use(_device(t))
    return drv.address_range(t.data_ptr())


def span_of(t: torch.Tensor) -> tuple[int, int]:
    """(base, size) of the memory a region holding `t` covers: its cudaMalloc allocation,
    or the VMM allocations mapped back to back under it."""
    drv = driver()
    drv.use(_device(t))
    start = t.data_ptr()
    chunks = vmm.chunks_over(drv, start, start + max(t.numel() * t.element_size(), 1))
    if not chunks:
        return drv.address_range(start)
    return chunks[0].base, chunks[-1].base + chunks[-1].size - chunks[0].base


def spans(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[int, int, list[tuple[str, torch.Tensor]]]]:
    """The tensors grouped by the memory they are in: (base, size, members), one per
    allocation (cudaMalloc) or per run of overlapping VMM allocations, by address."""
    return merge([(*span_of(t), (name, t)) for name, t in tensors])


def merge(found: list[tuple[int, int, T]]) -> list[tuple[int, int, list[T]]]:
    """(base, size, item) spans grouped where they overlap: (base, size, items), by base.
    Spans that only touch stay apart (two allocations mapped back to back by chance)."""
    groups: list[tuple[int, int, list[T]]] = []
    for base, size, item in sorted(found, key=lambda s: s[0]):
        if groups and base < groups[-1][0] + groups[-1][1]:  # overlaps the last one
            gbase, gsize, members = groups[-1]
            groups[-1] = (gbase, max(gsize, base + size - gbase), [*members, item])
        else:
            groups.append((base, size, [item]))
    return groups


def region_at(
    device: int, base: int, size: int, fd_socket: str, what: str, *, prefer_ipc: bool = False
) -> CudaRegion:
    """The CudaRegion of [base, base + size) on `device`: its IPC handle, or its VMM
    allocations passed as fds to `fd_socket` (RegistrationError naming `what` where they
    cannot be shared). VMM memory that allows fds goes as fds (a range of several
    allocations, and a daemon that can let go of it), unless `prefer_ipc` and one IPC
    handle covers it (any daemon of the host can then open it)."""
    drv = driver()
    drv.use(device)
    chunks = vmm.chunks_over(drv, base, base + size)
    uuid = drv.devices[device].uuid
    if chunks and all(c.posix_fd_ok for c in chunks) and not (prefer_ipc and len(chunks) == 1):
        return _vmm_region(chunks, uuid, base, fd_socket, what)
    alloc, _ = drv.address_range(base)
    try:
        handle = drv.ipc_handle(alloc)
    except CudaError as exc:
        if chunks:  # VMM memory no process can map: say what to set
            return _vmm_region(chunks, uuid, base, fd_socket, what)
        raise RegistrationError(
            f"cannot share the GPU memory of {what} through CUDA IPC ({exc.message})",
            code=ErrorCode.INVALID,
        ) from None
    EXPORTED[handle] = alloc
    return CudaRegion(device_uuid=uuid, ipc_handle=handle, offset=base - alloc)


def _vmm_region(
    chunks: list[vmm.Chunk], uuid: str, base: int, fd_socket: str, what: str
) -> CudaRegion:
    refused = next((c for c in chunks if not c.posix_fd_ok), None)
    if refused is not None and not refused.handle_types:
        raise RegistrationError(NOT_SHAREABLE.format(what=what), code=ErrorCode.INVALID)
    if refused is not None:  # e.g. fabric handles only (PyTorch's choice where IMEX runs)
        raise RegistrationError(
            f"cannot register {what}: its GPU memory is a CUDA VMM allocation that allows "
            f"handle types {refused.handle_types:#x} but not POSIX file descriptors (0x1), "
            "the only kind weightwire maps (PyTorch's expandable segments choose fabric "
            "handles where the driver supports them: leave PYTORCH_CUDA_ALLOC_CONF's "
            "expandable_segments off there)",
            code=ErrorCode.INVALID,
        )
    if not fd_socket:
        raise RegistrationError(
            f"cannot register {what}: its GPU memory is CUDA VMM memory, passed to the daemon "
            "as file descriptors, and this daemon has no fd socket (upgrade weightwired)",
            code=ErrorCode.INVALID,
        )
    if len(chunks) > fdpass.MAX_FDS:
        raise RegistrationError(
            f"cannot register {what}: it spans {len(chunks)} VMM allocations, more than "
            f"{fdpass.MAX_FDS}",
            code=ErrorCode.INVALID,
        )
    drv = driver()
    fds: list[int] = []
    try:
        for c in chunks:
            fds.append(vmm.export_fd(drv, c.base))
        token = fdpass.new_token()
        try:
            fdpass.send(fd_socket, token, fds)
        except fdpass.FdPassError as exc:
            raise RegistrationError(f"cannot register {what}: {exc}") from None
    except CudaError as exc:
        raise RegistrationError(
            f"cannot export the VMM memory of {what}: {exc.message}", code=ErrorCode.INVALID
        ) from None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return CudaRegion(
        device_uuid=uuid,
        ipc_handle=b"",
        offset=base - chunks[0].base,
        vmm_token=token,
        vmm_sizes=tuple(c.size for c in chunks),
    )


def region_of(
    t: torch.Tensor,
    base: int | None = None,
    *,
    fd_socket: str = "",
    what: str = "a tensor",
    prefer_ipc: bool = False,
) -> CudaRegion:
    """The CudaRegion starting at `base` (default: at `t` itself) of the memory `t` is in."""
    first, size = span_of(t)
    start = t.data_ptr() if base is None else base
    return region_at(
        _device(t), start, first + size - start, fd_socket, what, prefer_ipc=prefer_ipc
    )


def gpu_uuid(device: int | None) -> str:
    """The UUID of CUDA device `device` (as the daemon knows it); "" for None."""
    if device is None:
        return ""
    return driver().devices[device].uuid
