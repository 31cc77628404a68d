"""Host memory shared between a rank and its daemon: a file in /dev/shm, mapped by both.

The rank creates the file and maps it; the daemon opens and maps the same file once,
when the rank registers it. Either side may unlink the name once both have it open.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass, field

from weightwire.protocol.errors import ErrorCode, RegistrationError

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE


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
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.map))

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


def create_shared(length: int, *, prefix: str = "weightwire", mode: int = 0o600) -> SharedFile:
    if length <= 0:
        raise RegistrationError(f"a shared region needs a positive length, not {length}")
    path = os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
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
