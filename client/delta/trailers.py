"""What each engine rank's trailer of one version says, gathered as the rank's buckets go
by: a checksum of every range this rank writes there (in write order), those ranges, and
the payloads sent in place of dense bytes; written into the delta-out region after the
last bucket."""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightwire.protocol.plan import Bucket, DeltaSlot, RankPlan, WriteOp

from . import digest, frames

Dst = tuple[str, int]  # (engine node, immediate slot)
SourceBytes = Callable[[int, int, int], torch.Tensor]
"""source_bytes(region, offset, length) of a zero-copy source region the rank registered."""


def src_blocks(w: WriteOp) -> list[tuple[int, int]]:
    return [(w.src_offset + i * w.src_stride, w.length) for i in range(w.count)]


class Trailers:
    """One version's trailers, per engine rank that takes them (`RankPlan.trailers`)."""

    def __init__(self) -> None:
        self.dsts: set[Dst] = set()
        self._refs: dict[Dst, list[tuple[int, int]]] = {}
        self._parts: dict[Dst, list[int]] = {}
        self._ranges: dict[Dst, list[frames.Range]] = {}

    def begin(self, plan: RankPlan) -> None:
        self.dsts = {(t.dst_node, t.slot) for t in plan.trailers}
        self._refs = {}
        self._parts = {}  # per engine rank: range checksums so far
        self._ranges = {}

    def hashed(self, w: WriteOp) -> bool:
        """Whether write `w` lands at an engine rank that takes a trailer."""
        return (w.dst_node, w.slot) in self.dsts

    def add(self, w: WriteOp, part: int) -> None:
        """Write `w`'s range, its checksum `part`."""
        dst = (w.dst_node, w.slot)
        self._parts.setdefault(dst, []).append(part)
        self._ranges.setdefault(dst, []).append(
            (w.dst_region, w.dst_offset, w.length, w.count, w.dst_stride)
        )

    def sent(self, ds: DeltaSlot, nbytes: int) -> None:
        """A payload of `nbytes` was encoded for delta slot `ds`."""
        self._refs.setdefault((ds.dst_node, ds.slot), []).append((ds.dst_offset, nbytes))

    def checksum(
        self,
        b: Bucket,
        staging: torch.Tensor | None,
        shift: int,
        source_bytes: SourceBytes,
        gpu_region: Callable[[str, int], bool],
    ) -> None:
        """The checksums of bucket b's writes to engine ranks with trailers, read where
        they are packed (`staging` at their offsets + `shift`) or in a zero-copy source."""
        for w in b.writes:
            if not self.hashed(w):
                continue
            blocks = []
            for off, n in src_blocks(w):
                if w.src_region < 0:
                    assert staging is not None
                    blocks.append(staging[off + shift : off + shift + n])
                else:
                    blocks.append(source_bytes(w.src_region, off, n))
            self.add(w, digest.range_digest(blocks, gpu_region(w.dst_node, w.dst_region)))

    def write(self, plan: RankPlan, version: int, base: int, out: torch.Tensor) -> list[int]:
        """Write each trailer into `out` (queued on the current stream for a GPU `out`);
        their lengths."""
        lengths = []
        for t in plan.trailers:
            dst = (t.dst_node, t.slot)
            refs = tuple(self._refs.get(dst, ()))
            head = frames.TrailerHead(
                sender=plan.rank,
                version=version,
                base=base if refs else -1,
                digest=digest.combine(self._parts.get(dst, [])),
                ranges=tuple(self._ranges.get(dst, ())),
                deltas=refs,
            )
            data = frames.trailer(head)
            if len(data) > t.capacity:
                raise ValueError(f"a trailer of {len(data)} bytes for a slot of {t.capacity}")
            out[t.src_offset : t.src_offset + len(data)].copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
            lengths.append(len(data))
        return lengths
