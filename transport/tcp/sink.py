"""Where a tcp receive stream's writes land: host regions directly, GPU regions in pieces
through a bounded bounce buffer; a write of a version the node failed nowhere."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.transport.base import Admit, LocalRegion
from weightwire.transport.tcp.data import Write

from .bounce import Bounce
from .regions import RegionTable


@dataclass(eq=False)
class StreamSink:
    """One receive stream's sink: host regions directly, GPU regions piece by piece through
    a bounce (`new_bounce` makes it, bounded, at the first GPU write). A write whose tag
    (its immediate) the admission check refuses lands nowhere."""

    table: RegionTable
    admit: Admit | None = None
    new_bounce: Callable[[], Bounce] = Bounce
    bounce: Bounce | None = None
    _gpu: LocalRegion | None = None  # the GPU region the write under way lands in
    _host: memoryview | None = None  # or the host memory
    _at: int = 0  # the write's offset where the piece in the bounce begins

    def target(self, write: Write, peer: str) -> memoryview:
        # `peer` is the authenticated writer: a failed version's write is refused before any
        # byte of it lands, then the region's writers and rkey are checked
        if write.tag >= 0 and self.admit is not None and not self.admit(peer, write.tag):
            raise RegionError(
                f"write to region {write.region} belongs to a version this node failed",
                code=ErrorCode.ABORTED,
            )
        region = self.table.lookup(write, peer)
        self._gpu, self._host, self._at = None, None, 0
        if region.kind == "cpu":
            self._host = self.table.host_view(region, write)
            return self._host
        if self.bounce is None:
            self.bounce = self.new_bounce()
        self._gpu = region
        assert region.device is not None
        return self.bounce.buffer(min(write.length, self.bounce.cap), region.device)

    def piece(self, write: Write, done: int) -> memoryview:
        """The first `done` bytes are in: the piece in the bounce goes to the GPU, and the
        bounce takes the next."""
        if self._gpu is None:  # host memory is given whole: the rest of it
            assert self._host is not None
            return self._host[done:]
        assert self.bounce is not None and self._gpu.device is not None
        self._flush(write, done)
        self._at = done
        return self.bounce.buffer(min(write.length - done, self.bounce.cap), self._gpu.device)

    def landed(self, write: Write) -> None:
        if self._gpu is not None:
            self._flush(write, write.length)
        self._gpu, self._host = None, None

    def _flush(self, write: Write, done: int) -> None:
        """The bounce's bytes (the write's from `_at` to `done`) to the GPU region."""
        assert self._gpu is not None and self._gpu.device is not None and self.bounce
        dst = self._gpu.address + write.offset + self._at
        self.bounce.to_device(self._gpu.device, dst, done - self._at)

    def close(self) -> None:
        """Gives the bounce's pinned memory back (the stream's thread has ended)."""
        if self.bounce is not None:
            self.bounce.close()
