"""Where a tcp receive stream's writes land: host regions directly, GPU regions through a
bounce buffer; a write of a version the node failed nowhere."""

from __future__ import annotations

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.transport.base import Admit, LocalRegion
from weightwire.transport.tcp.data import Write

from .bounce import Bounce
from .regions import RegionTable


class StreamSink:
    """One receive stream's sink: host regions directly, GPU regions through a bounce.
    A write whose tag (its immediate) the admission check refuses lands nowhere."""

    def __init__(self, table: RegionTable, admit: Admit | None = None) -> None:
        self.table = table
        self.admit = admit
        self.bounce: Bounce | None = None
        self._gpu: LocalRegion | None = None

    def target(self, write: Write, peer: str) -> memoryview:
        # `peer` is the authenticated writer: a failed version's write is refused before any
        # byte of it lands, then the region's writers and rkey are checked
        if write.tag >= 0 and self.admit is not None and not self.admit(peer, write.tag):
            raise RegionError(
                f"write to region {write.region} belongs to a version this node failed",
                code=ErrorCode.ABORTED,
            )
        region = self.table.lookup(write, peer)
        if region.kind == "cpu":
            self._gpu = None
            return self.table.host_view(region, write)
        self.bounce = self.bounce or Bounce()
        self._gpu = region
        assert region.device is not None
        return self.bounce.buffer(write.length, region.device)

    def landed(self, write: Write) -> None:
        if self._gpu is not None and self.bounce is not None:
            assert self._gpu.device is not None
            self.bounce.to_device(self._gpu.device, self._gpu.address + write.offset, write.length)
            self._gpu = None
