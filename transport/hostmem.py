"""Host memory shared between a rank and its daemon: a file in /dev/shm, mapped by both.

The rank creates the file and maps it; the daemon opens and maps the same file once,
when the rank registers it. Either side may unlink the name once both have it open.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass, field

from weightwire.protocol.errors import ErrorCode, RegistrationError

SHM_DIR = "/dev/shm"
PREFIX = "weightwire"


def address_of(buffer: memoryview | mmap.mmap) -> int:
    """The address of a writable buffer (the temporary ctypes export ends at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def page_span(address: int, length: int) -> tuple[int, int]:
    """(start, length) of the whole pages that hold `length` bytes at `address`."""
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    return start, -(-(address + length) // page) * page - start


@dataclass(eq=False)
class SharedFile:
    path: str
    length: int
    fd: int
    map: mmap.mmap
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.map)

    @property
    def address(self) -> int:
        return address_of(self.map)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> bool:
        """Unmap and close; False (and nothing closed) while views of it are still alive."""
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            self.view = memoryview(self.map)
            return False
        os.close(self.fd)
        return True


def create_shared(
    length: int, *, purpose: str = "region", mode: int = 0o660, gid: int | None = None
) -> SharedFile:
    """A new file in /dev/shm named weightwire.<pid>.<purpose>.<random>, mapped.

    The file keeps its name while the rank lives, so a restarted daemon can map it again;
    `unlink` it when done. `gid` hands it to the daemon's group (mode 0660).
    """
    if length <= 0:
        raise RegistrationError(f"a shared region needs a positive length, not {length}")
    path = os.path.join(SHM_DIR, f"{PREFIX}.{os.getpid()}.{purpose}.{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        if gid is not None and gid != os.getgid():
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        os.ftruncate(fd, length)
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return SharedFile(path, length, fd, m)


def open_shared(path: str, length: int) -> SharedFile:
    """Map a rank's shared file; the file must exist and be at least `length` bytes."""
    real = os.path.realpath(path)
    if os.path.dirname(real) != SHM_DIR:
        raise RegistrationError(f"region file {path!r} is not in {SHM_DIR}", code=ErrorCode.INVALID)
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise RegistrationError(f"cannot open region file {path!r}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < length:
            raise RegistrationError(
                f"region file {path!r} has {size} bytes, {length} were declared",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return SharedFile(real, length, fd, m)


def sweep_stale() -> list[str]:
    """Unlink region files whose creating process is gone (a rank that crashed)."""
    removed = []
    for name in os.listdir(SHM_DIR):
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
        except PermissionError:
            pass  # alive, someone else's
    return removed
