"""Host memory shared between a rank and its daemon: a file in /dev/shm, mapped by both.

The rank creates the file and maps it; the daemon opens and maps the same file once,
when the rank registers it. Either side may unlink the name once both have it open.

Every page is reserved when the file is made (`posix_fallocate`): a sparse file on a full
tmpfs would kill whoever first touches an unallocatable page with SIGBUS. No space is a
`RegionError` naming the path, the size and the space left instead.

The creator holds an flock on the file for as long as it has it open. That lock, not the
pid in the name, is how the stale-file sweep tells a live region from a crashed rank's:
pids mean nothing across PID namespaces (containers), locks on a shared tmpfs do.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass, field

from weightwire.protocol.errors import ErrorCode, RegionError, RegistrationError

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
        self._close_fd()
        return True

    def detach(self) -> None:
        """Unlink the name and close the descriptor (and with it the flock), leaving the
        mapping to whoever still reads it: tensors on it keep working, and its memory goes
        back to the filesystem when the last of them goes. What a rank that closes does
        with files its callers' tensors may still live in (an engine's adopted weights):
        kept open, a file's pages stayed allocated until the process exited."""
        self.unlink()
        self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer can still allocate in `directory`'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def reserve(fd: int, path: str, length: int) -> None:
    """Allocate every page of the file's first `length` bytes now, or raise RegionError."""
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG):
            raise RegionError(
                f"cannot reserve {length} bytes for region file {path}: {exc.strerror}",
                code=ErrorCode.INVALID,
            ) from None
        free = free_bytes(os.path.dirname(path))
        raise RegionError(
            f"no room for region file {path}: {length} bytes needed, {free} bytes free in "
            f"{os.path.dirname(path)} ({exc.strerror}); make it larger (size= of its tmpfs, "
            f"or the container's shm size) or need less",
            code=ErrorCode.NO_SPACE,
        ) from None


def _check_directory(directory: str) -> str:
    if "\0" in directory or not os.path.isabs(directory):
        raise RegistrationError(
            f"region directory {directory!r} must be an absolute path", code=ErrorCode.INVALID
        )
    return os.path.realpath(directory)


def create_shared(
    length: int,
    *,
    purpose: str = "region",
    mode: int = 0o660,
    gid: int | None = None,
    directory: str = SHM_DIR,
) -> SharedFile:
    """A new file in `directory` named weightwire.<pid>.<purpose>.<random>, mapped, every
    page reserved, and locked (flock) by this process while it has it open.

    The file keeps its name while the rank lives, so a restarted daemon can map it again;
    `unlink` it when done. `gid` hands it to the daemon's group (mode 0660).
    """
    if length <= 0:
        raise RegistrationError(f"a shared region needs a positive length, not {length}")
    directory = _check_directory(directory)
    while True:
        name = f"{PREFIX}.{os.getpid()}.{purpose}.{secrets.token_hex(6)}"
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        fcntl.flock(fd, fcntl.LOCK_SH)  # never contended but by a sweep, which lets go at once
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # a sweep took it between open and lock: make another
    try:
        if gid is not None and gid != os.getgid():
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        os.ftruncate(fd, length)
        reserve(fd, path, length)
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return SharedFile(path, length, fd, m)


def open_shared(path: str, length: int, directory: str = SHM_DIR) -> SharedFile:
    """Map a rank's shared file; the file must be in `directory` and hold `length` bytes.

    A sparse file (fewer blocks allocated than `length`: not made by `create_shared`) has
    its pages reserved here, so that it can never bring the daemon down when a write lands
    in it; one whose pages are all there costs one fstat.
    """
    if "\0" in path:
        raise RegistrationError(f"region file {path!r} contains a NUL byte", code=ErrorCode.INVALID)
    directory = _check_directory(directory)
    real = os.path.realpath(path)
    if os.path.dirname(real) != directory:
        raise RegistrationError(
            f"region file {path!r} is not in {directory}", code=ErrorCode.INVALID
        )
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistrationError(f"cannot open region file {path!r}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < length:
            raise RegistrationError(
                f"region file {path!r} has {size} bytes, {length} were declared",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        if os.fstat(fd).st_blocks * 512 < length:  # sparse: not made by create_shared
            reserve(fd, real, length)
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return SharedFile(real, length, fd, m)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink region files no live process holds (a rank that crashed): those whose flock
    this process can take. A rank in another PID namespace keeps its files."""
    removed = []
    for name in os.listdir(directory):
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != PREFIX:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
                    removed.append(name)
        finally:
            os.close(fd)
    return removed
