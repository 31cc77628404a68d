"""Where a tcp receive stream's writes land: host regions directly, GPU regions in pieces
through a bounded bounce buffer; a write of a version the node failed nowhere. A write
into a GPU region is counted in it from its lookup to its last copy (or its end), and
each copy checks that the region is still registered (`RegionTable.writing`): one
deregistered meanwhile fails the write `peer_lost`, and is unmapped only once no write is
counted in it."""

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
    _token: int = 0  # the registration of `_gpu` the write was looked up under (counted)

    def target(self, write: Write, peer: str) -> memoryview:
        # `peer` is the authenticated writer: a failed version's write is refused before any
        # byte of it lands, then the region's writers and rkey are checked
        if write.tag >= 0 and self.admit is not None and not self.admit(peer, write.tag):
            raise RegionError(
                f"write to region {write.region} belongs to a version this node failed",
                code=ErrorCode.ABORTED,
            )
        self._done()  # a write that ended without landing (refused): no longer counted
        region, token = self.table.writing(write, peer)
        self._gpu, self._host, self._at, self._token = None, None, 0, token
        if region.kind == "cpu":
            self._host = self.table.host_view(region, write)
            return self._host
        self._gpu = region
        try:
            if self.bounce is None:
                self.bounce = self.new_bounce()
            assert region.device is not None
            return self.bounce.buffer(min(write.length, self.bounce.cap), region.device)
        except BaseException:
            self._done()
            raise

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
        try:
            if self._gpu is not None:
                self._flush(write, write.length)
        finally:
            self._done()
            self._gpu, self._host = None, None

    def _flush(self, write: Write, done: int) -> None:
        """The bounce's bytes (the write's from `_at` to `done`) to the GPU region, if it
        is still registered as it was when the write began (else `peer_lost`)."""
        assert self._gpu is not None and self._gpu.device is not None and self.bounce
        self.table.still(self._gpu.id, self._token)
        dst = self._gpu.address + write.offset + self._at
        self.bounce.to_device(self._gpu.device, dst, done - self._at)

    def _done(self) -> None:
        """The write under way is no longer counted in its GPU region (no copy left)."""
        if self._token:
            assert self._gpu is not None
            self._token = 0
            self.table.done(self._gpu.id)

    def close(self) -> None:
        """Gives the bounce's pinned memory back (the stream's thread has ended): a write
        cut short is no longer counted in its region."""
        self._done()
        if self.bounce is not None:
            self.bounce.close()
