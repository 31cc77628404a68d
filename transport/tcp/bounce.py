"""GPU memory over tcp: bytes pass through pinned host memory of the stream's own.

A receive stream lands a write's payload in the bounce buffer and copies it to the GPU
before the write counts as landed (so the immediate still follows the bytes); a send
stream copies from the GPU first. Each stream has one buffer, grown to the largest write.
"""

from __future__ import annotations

from weightwire.memory.cudadrv import driver

MIN_BYTES = 8 << 20


class Bounce:
    def __init__(self) -> None:
        self._address = 0
        self._view: memoryview | None = None
        self._size = 0
        self._device: int | None = None
        self._stream = 0

    def buffer(self, nbytes: int, device: int) -> memoryview:
        """At least `nbytes` of pinned memory (allocated with `device`'s context current)."""
        if nbytes > self._size:
            self._on(device)
            drv = driver()
            if self._address:
                if self._view is not None:
                    self._view.release()
                drv.host_free(self._address)
            self._size = max(nbytes, MIN_BYTES)
            self._address, self._view = drv.host_alloc(self._size)
        assert self._view is not None
        return self._view[:nbytes]

    def _on(self, device: int) -> None:
        if self._device != device:
            drv = driver()
            drv.use(device)
            self._stream = drv.stream()
            self._device = device

    def to_device(self, device: int, dst: int, nbytes: int) -> None:
        """The first `nbytes` of the buffer to device memory at `dst` (blocks until done)."""
        self._on(device)
        drv = driver()
        drv.copy_async(dst, self._address, nbytes, self._stream)
        drv.synchronize(self._stream)

    def from_device(self, device: int, src: int, nbytes: int) -> memoryview:
        view = self.buffer(nbytes, device)
        self._on(device)
        drv = driver()
        drv.copy_async(self._address, src, nbytes, self._stream)
        drv.synchronize(self._stream)
        return view

    def close(self) -> None:
        if self._address:
            if self._view is not None:
                self._view.release()
            driver().host_free(self._address)
            self._address, self._view, self._size = 0, None, 0
