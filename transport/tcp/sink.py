"""Where a tcp receive stream's writes land: host regions directly, GPU regions in pieces
through a bounded bounce buffer; a write of a version the node failed nowhere. A write
into a GPU region is counted in it from its lookup to its last copy (or its end), and
each copy checks that the region is still registered (`RegionTable.writing`): one
deregistered meanwhile fails the write `peer_lost`, and is unmapped only once no write is
counted in it.

A host region a rank registered is its shared file, mapped here: a rank can shrink it
(ftruncate) under the daemon, and a store to a page past the new end is a SIGBUS that no
Python handler survives. So a write checks the file still holds the registered bytes
before and after it lands, and where the daemon's own code would store the bytes (an
encrypted stream decrypts them) they go to the file with `pwrite` instead, from a buffer
of the stream's own: a shrunk file makes them fail, typed. `recv_into` (every other
stream) copies in the kernel, which answers a missing page with EFAULT, not a signal."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.transport.base import Admit, LocalRegion
from weightwire.transport.tcp.data import Write

from . import auth
from .bounce import Bounce
from .regions import RegionTable

PRIVATE_BYTES = auth.RECORD  # a private stream's buffer: one record, written as it is checked


def check_file(region: LocalRegion) -> None:
    """RegionError when the file behind host region `region` no longer holds its bytes."""
    if region.kind != "cpu" or region.fd is None:
        return
    try:
        size = os.fstat(region.fd).st_size
    except OSError as exc:
        raise RegionError(f"region {region.id} of {region.owner}: {exc.strerror}") from None
    if size < region.length:
        raise RegionError(
            f"region {region.id} of {region.owner}: its file holds {size} bytes, "
            f"{region.length} were registered (shrunk under the daemon by a process that "
            "can open it); nothing lands in it until it is registered again",
            code=ErrorCode.OUT_OF_BOUNDS,
        )


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
    _file: LocalRegion | None = None  # or the host region it reaches through pwrite
    _hostregion: LocalRegion | None = None  # the host region it lands in, either way
    _private: memoryview | None = None  # the buffer for that (made on first use)
    _at: int = 0  # the write's offset where the piece in the bounce (or buffer) begins
    _token: int = 0  # the registration of `_gpu` the write was looked up under (counted)

    def target(self, write: Write, peer: str, private: bool = False) -> memoryview:
        """`private`: the stream's own code stores the bytes (it decrypts them), so a host
        region's go through a buffer of its own and `pwrite`, never to its mapping."""
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
        self._file, self._hostregion = None, None
        if region.kind == "cpu":
            host = self.table.host_view(region, write)
            check_file(region)
            self._hostregion = region
            if private and region.fd is not None:
                self._file = region
                return self._buffer(write.length)
            self._host = host
            return host
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
        if self._file is not None:
            self._put(write, done)
            self._at = done
            return self._buffer(write.length - done)
        if self._gpu is None:  # host memory is given whole: the rest of it
            assert self._host is not None
            return self._host[done:]
        assert self.bounce is not None and self._gpu.device is not None
        self._flush(write, done)
        self._at = done
        return self.bounce.buffer(min(write.length - done, self.bounce.cap), self._gpu.device)

    def landed(self, write: Write) -> None:
        """Its last bytes in; refused if its host region's file shrank meanwhile (what
        landed past the new end is gone)."""
        host = self._hostregion
        try:
            if self._gpu is not None:
                self._flush(write, write.length)
            elif self._file is not None:
                self._put(write, write.length)
        finally:
            self._done()
            self._gpu, self._host, self._file, self._hostregion = None, None, None, None
        if host is not None:
            check_file(host)

    def _buffer(self, left: int) -> memoryview:
        if self._private is None:
            self._private = memoryview(bytearray(PRIVATE_BYTES))
        return self._private[: min(left, PRIVATE_BYTES)]

    def _put(self, write: Write, done: int) -> None:
        """The buffer's bytes (the write's from `_at` to `done`) into the region's file."""
        region = self._file
        assert region is not None and region.fd is not None and self._private is not None
        data = self._private[: done - self._at]
        at = write.offset + self._at
        while data:
            try:
                n = os.pwrite(region.fd, data, at)
            except OSError as exc:
                raise RegionError(
                    f"region {region.id} of {region.owner}: {exc.strerror}",
                    code=ErrorCode.NO_SPACE if exc.errno == errno.ENOSPC else ErrorCode.TRANSFER,
                ) from None
            data, at = data[n:], at + n

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
