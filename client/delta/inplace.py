"""A bucket's staging bytes read where they already are: the rank's own tensors.

On the host, a delta bucket's compare needs the new bytes, not staging: where every pack
op of a bucket is a plain copy of a contiguous box of a host tensor, the staging bytes
at [op.staging_offset, + op.nbytes) *are* that box's bytes. The sender then compares
the tensors against the shadow in place and packs the bucket only if some of its writes
still read staging (a destination that gets it dense, a payload that did not fit):
at low density a delta version copies nothing into staging at all.

`Planned` (staging itself, at planned offsets) and `InPlace` answer the same three
questions: the bytes of a planned range, the same range as pieces that never span two
sources, and the offsets where sources meet (the host pass cuts its segments there).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import torch

from weightwire.protocol.plan import Bucket
from weightwire.protocol.tensors import Copy

from ..buckets import merged, slice_box


class Planned:
    """Staging addressed at planned offsets: bucket bytes at `offset` are at `offset +
    shift` of the ring (shift 0 for a whole-send staging)."""

    cuts: tuple[int, ...] = ()

    def __init__(self, staging: torch.Tensor, shift: int) -> None:
        self.staging, self.shift = staging, shift

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.staging[s.start + self.shift : s.stop + self.shift]

    def pieces(self, off: int, length: int) -> list[tuple[int, torch.Tensor]]:
        return [(off, self[off : off + length])]


class InPlace:
    """A bucket's planned staging range -> the bytes of the tensors it would be packed from."""

    def __init__(self, spans: list[tuple[int, int, torch.Tensor]]) -> None:
        self.spans = sorted(spans, key=lambda s: s[0])
        self.starts = [s[0] for s in self.spans]
        self.cuts = tuple(sorted({e for off, n, _ in self.spans for e in (off, off + n)}))

    @classmethod
    def of(cls, b: Bucket, tensors: Mapping[str, torch.Tensor]) -> InPlace | None:
        """None unless every pack op of b is a copy of a contiguous box of a host tensor,
        those boxes do not overlap, and they cover every staging byte b's writes read."""
        spans = []
        for op in b.packs:
            t = tensors.get(op.source)
            if not isinstance(op.transform, Copy) or t is None or t.device.type != "cpu":
                return None
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or merged(t, op.box):
                return None
            view = slice_box(t, op.box)
            if not view.is_contiguous() or view.numel() * view.element_size() != op.nbytes:
                return None
            spans.append((op.staging_offset, op.nbytes, view.reshape(-1).view(torch.uint8)))
        if not spans:
            return None
        out = cls(spans)
        for a, b_ in zip(out.spans, out.spans[1:], strict=False):
            if a[0] + a[1] > b_[0]:
                return None
        for wr in b.writes:
            if wr.src_region < 0:
                for i in range(wr.count):
                    if not out._covers(wr.src_offset + i * wr.src_stride, wr.length):
                        return None
        return out

    def _covers(self, off: int, length: int) -> bool:
        end = off + length
        i = bisect.bisect_right(self.starts, off) - 1
        while off < end:
            if i < 0 or i >= len(self.spans):
                return False
            start, n, _ = self.spans[i]
            if not start <= off < start + n:
                return False
            off, i = start + n, i + 1
        return True

    def pieces(self, off: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """(planned offset, bytes) of [off, off + length), one piece per source."""
        out = []
        end = off + length
        i = bisect.bisect_right(self.starts, off) - 1
        while off < end:
            start, n, data = self.spans[i]
            stop = min(end, start + n)
            out.append((off, data[off - start : stop - start]))
            off, i = stop, i + 1
        return out

    def __getitem__(self, s: slice) -> torch.Tensor:
        parts = self.pieces(s.start, s.stop - s.start)
        return parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts])


def needs_staging(b: Bucket, sent: list[tuple[int, int, int]]) -> bool:
    """Whether some write of b still reads staging once the payloads `sent` ((bucket,
    delta slot, bytes)) replaced theirs."""
    replaced = {i for _, index, _ in sent for i in b.deltas[index].writes}
    return any(wr.src_region < 0 and i not in replaced for i, wr in enumerate(b.writes))
