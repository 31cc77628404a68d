"""The copies a cuda lane issues: one write as the copying device sees it (`Copy`), the
writes of a post cut into chunks that one event completes (`Chunk`, `chunks`: once per
`prepare`), and how one copy is queued on a stream (`issue`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightwire.memory.cudaabi import MAX_PITCH
from weightwire.memory.cudadrv import Driver

from .inflight import Key

# One chunk (one event) holds at most this much, so that landings are reported, and the
# budget comes back, while a large post is still copying.
BATCH_OPS = 64
BATCH_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Copy:
    """One write, as the copying device sees it: the same every time it is posted."""

    index: int  # of the write in its post
    dst: int
    src: int
    nbytes: int
    dst_node: str
    dst_device: int = -1  # set when the copy crosses GPUs through cuMemcpyPeerAsync
    count: int = 1  # blocks of `nbytes` (a strided write), one 2-D copy
    src_stride: int = 0
    dst_stride: int = 0
    dst_region: int = -1  # the destination's region id
    token: int = 0  # its registration, when it is counted (`inflight`), else 0
    # where it is counted, when not as (dst_node, dst_region): a region of another process
    # opened by its IPC handle is counted per writer and handle (`remote.py`)
    via: str = ""

    @property
    def key(self) -> Key:
        """Where its copies are counted in flight (`inflight.REGIONS`)."""
        return (self.via or self.dst_node, self.dst_region)

    @property
    def as_2d(self) -> bool:
        return (
            self.count > 1
            and self.dst_device < 0
            and max(self.src_stride, self.dst_stride) <= MAX_PITCH
        )

    @property
    def size(self) -> int:
        """Bytes it moves."""
        return self.nbytes * self.count

    @property
    def ops(self) -> int:
        """Driver calls that issue it."""
        return 1 if self.as_2d or self.count == 1 else self.count


@dataclass(frozen=True, slots=True)
class Chunk:
    """Copies issued together and completed by one event (cut once, reused every post)."""

    copies: tuple[Copy, ...]
    ops: int  # driver calls, the event's included
    nbytes: int
    node: str  # the node every copy writes to; "" when they differ
    regions: tuple[tuple[Key, int], ...] = ()  # counted regions it writes: their tokens


def chunks(copies: Sequence[Copy]) -> list[Chunk]:
    """`copies` in order, cut into chunks of at most BATCH_OPS operations and BATCH_BYTES
    (a single larger copy is a chunk of its own)."""
    cuts: list[tuple[list[Copy], int, int]] = []  # (copies, their ops, their bytes)
    for c in copies:
        if cuts:
            cut, ops, nbytes = cuts[-1]
            if ops + c.ops <= BATCH_OPS and nbytes + c.size <= BATCH_BYTES:
                cut.append(c)
                cuts[-1] = (cut, ops + c.ops, nbytes + c.size)
                continue
        cuts.append(([c], c.ops, c.size))
    out = []
    for cut, ops, nbytes in cuts:
        nodes = {c.dst_node for c in cut}
        node = nodes.pop() if len(nodes) == 1 else ""
        regions = tuple({(c.key, c.token) for c in cut if c.token})
        out.append(Chunk(tuple(cut), ops + 1, nbytes, node, regions))
    return out


def issue(drv: Driver, c: Copy, device: int, stream: int) -> None:
    """Queue one write's copies on `stream`: a strided write as one 2-D copy."""
    if c.as_2d:
        drv.copy_2d_async(c.dst, c.dst_stride, c.src, c.src_stride, c.nbytes, c.count, stream)
        return
    for i in range(c.count):
        dst, src = c.dst + i * c.dst_stride, c.src + i * c.src_stride
        if c.dst_device >= 0:
            drv.copy_peer_async(dst, c.dst_device, src, device, c.nbytes, stream)
        else:
            drv.copy_async(dst, src, c.nbytes, stream)
