"""GPU memory over tcp: bytes pass through pinned host memory of the stream's own.

Each stream holds at most `cap` bytes of pinned memory (`tcp_bounce_bytes`): pinned pages
cannot be swapped, and a buffer grown to the largest write let any writer with a valid
key make this host pin gigabytes per connection. A write larger than the cap moves in
pieces of at most `cap` bytes (a whole number of `auth.RECORD`s, so that no sealed record
straddles two pieces): a receive stream lands a piece in the buffer and copies it to the
GPU before it takes the next, and the write counts as landed (its immediate delivered)
only once its last piece is on the device; a send stream copies a piece from the GPU,
sends it, then copies the next. The wire is the same whatever the cap.

Every copy's wait is bounded (`timeout_s`): a copy not done by then fails the write
(TimeoutError_) and the buffer is never used or freed again (the device may still be
writing to it).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import structlog

from weightwire.memory.cudadrv import CudaError, driver
from weightwire.protocol.errors import TimeoutError_

from .auth import RECORD

log = structlog.get_logger("weightwire.transport.tcp")

DEFAULT_CAP = 64 << 20  # bytes of pinned memory a stream may hold (tcp_bounce_bytes)
MIN_BYTES = 8 << 20  # the first buffer's size, where the cap allows it
NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuStreamQuery's "not yet"
POLL_MAX_S = 50e-6  # the longest sleep between two looks at a copy, once it is due
COPY_BYTES_S = 45e9  # a pinned copy's rate (H100: 54 GB/s): a copy is not looked at before


def piece_bytes(cap: int) -> int:
    """The largest piece under `cap`: a whole number of records, at least one."""
    return max(RECORD, cap - cap % RECORD)


def pieces(length: int, cap: int) -> Iterator[tuple[int, int]]:
    """(offset, bytes) of each piece of a `length`-byte write through a `cap`-byte bounce."""
    step = piece_bytes(cap)
    for start in range(0, length, step):
        yield start, min(step, length - start)


class Pinned:
    """The pinned bytes that a transport's bounce buffers hold, for its stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0  # held now, by every stream
        self.largest = 0  # the largest buffer any stream has held

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.now += nbytes
            self.largest = max(self.largest, nbytes)

    def remove(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes


class Bounce:
    """One stream's pinned buffer: at most `cap` bytes, allocated on first use."""

    def __init__(
        self, cap: int = DEFAULT_CAP, timeout_s: float = 30.0, pinned: Pinned | None = None
    ) -> None:
        self.cap = piece_bytes(cap)
        self.timeout_s = timeout_s
        self._pinned = pinned or Pinned()
        self._address = 0
        self._view: memoryview | None = None
        self._size = 0
        self._device: int | None = None
        self._stream = 0
        self._streams: dict[int, int] = {}  # a copy stream per device, made once
        self._lost = False  # a copy timed out: the device may still use the buffer

    @property
    def size(self) -> int:
        """Bytes of pinned memory held now (never more than `cap`)."""
        return self._size

    def buffer(self, nbytes: int, device: int) -> memoryview:
        """`nbytes` (at most `cap`) of pinned memory, allocated with `device`'s context."""
        if nbytes > self.cap:
            raise ValueError(f"a piece of {nbytes} bytes through a bounce of {self.cap}")
        if self._lost:
            raise CudaError("this stream's bounce buffer was lost to a copy that timed out")
        if nbytes > self._size:
            self._on(device)
            drv = driver()
            self._release()
            size = min(self.cap, max(nbytes, MIN_BYTES))
            self._address, self._view = drv.host_alloc(size)
            self._size = size
            self._pinned.add(size)
        assert self._view is not None
        return self._view[:nbytes]

    def _on(self, device: int) -> None:
        """`device`'s context current in this thread, and its copy stream."""
        if self._device != device:
            drv = driver()
            drv.use(device)
            if device not in self._streams:
                self._streams[device] = drv.stream()
            self._stream = self._streams[device]
            self._device = device

    def to_device(self, device: int, dst: int, nbytes: int) -> None:
        """The first `nbytes` of the buffer to device memory at `dst` (returns once there)."""
        self._on(device)
        driver().copy_async(dst, self._address, nbytes, self._stream)
        self._wait(nbytes)

    def from_device(self, device: int, src: int, nbytes: int) -> memoryview:
        """`nbytes` of device memory at `src` into the buffer (at most `cap`): its view."""
        view = self.buffer(nbytes, device)
        self._on(device)
        driver().copy_async(self._address, src, nbytes, self._stream)
        self._wait(nbytes)
        return view

    def _wait(self, nbytes: int) -> None:
        """Until the stream's copies are done, at most `timeout_s` (TimeoutError_ then)."""
        drv = driver()
        stream = ctypes.c_void_p(self._stream)
        deadline = time.monotonic() + self.timeout_s
        # one sleep for the copy's expected time first: each wake-up takes the GIL back, and
        # polling from the start (20 us doubling to 1 ms) moved the CPU replica into an H100
        # at 6.4-8.1 GB/s against 9.0-9.2 with a blocking synchronize
        time.sleep(nbytes / COPY_BYTES_S)
        pause = 20e-6
        while (rc := drv.try_call("cuStreamQuery", stream)) == NOT_READY:
            if time.monotonic() >= deadline:
                self._lost = True
                log.error("tcp bounce copy timed out; its buffer is abandoned", bytes=nbytes)
                raise TimeoutError_(
                    f"a copy of {nbytes} bytes between the GPU and pinned memory took over "
                    f"{self.timeout_s:.0f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        if rc != 0:
            raise CudaError(f"copy through the bounce buffer failed: {drv.error_name(rc)}")

    def _release(self) -> None:
        if self._address:
            if self._view is not None:
                self._view.release()
            driver().host_free(self._address)
            self._pinned.remove(self._size)
            self._address, self._view, self._size = 0, None, 0

    def close(self) -> None:
        """Gives the pinned memory back (not after a copy timed out: see `_wait`). Never
        raises: it runs as a stream's thread ends."""
        if self._lost:
            return
        try:
            self._release()
            for stream in self._streams.values():
                driver().call("cuStreamDestroy_v2", ctypes.c_void_p(stream))
        except CudaError as exc:
            log.error("tcp bounce not freed", error=exc.message)
        self._streams.clear()
        self._device = None
