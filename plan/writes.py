"""A bucket's writes: sends merged where both ends are contiguous, cut into chunks of at
most `max_write_bytes`, equal chunks evenly spaced at both ends gathered into strided
writes (one slice of every expert of a layer is one write, not one per expert), and
striped over the lanes both ends have."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire.protocol.plan import WriteOp

from .options import PlanOptions

if TYPE_CHECKING:
    from .layout import Send

Target = tuple[str, int, int, int]  # (node, engine rank, destination region, source region)


class _Run:
    """Chunks of `n` bytes, block i at src + i * src_stride -> dst + i * dst_stride."""

    __slots__ = ("count", "dst", "dst_stride", "n", "src", "src_stride", "target")

    def __init__(self, src: int, n: int, dst: int, target: Target) -> None:
        self.src, self.n, self.dst, self.target = src, n, dst, target
        self.count, self.src_stride, self.dst_stride = 1, 0, 0

    def extend(self, src: int, dst: int, cap: int) -> bool:
        """Take the chunk at (src, dst) as the next block, if it continues the run."""
        if (self.count + 1) * self.n > cap:
            return False
        if self.count == 1:
            ss, ds = src - self.src, dst - self.dst
            if ss < self.n or ds < self.n:
                return False
            self.src_stride, self.dst_stride = ss, ds
        elif (
            src != self.src + self.count * self.src_stride
            or dst != self.dst + self.count * self.dst_stride
        ):
            return False
        self.count += 1
        return True


def writes_of(
    sends: list[Send],
    options: PlanOptions,
    slots: dict[int, int],
    src_lanes: int = 1,
    dst_lanes: dict[int, int] | None = None,
) -> list[WriteOp]:
    """The writes of one bucket's sends. Each write has its own immediate, so the
    destination counts writes (stripes included) exactly."""
    runs = _runs(_chunks(sends, options.max_write_bytes), options.max_write_bytes)
    out: list[WriteOp] = []
    src_lanes = max(1, src_lanes)
    for r in runs:
        node, rank, region, src_region = r.target
        lanes = max(1, min(src_lanes, (dst_lanes or {}).get(rank, 1)))
        k = max(1, min(lanes, r.n * r.count // max(1, options.min_stripe_bytes)))
        if r.count == 1:  # stripes: byte ranges of the chunk
            step = -(-r.n // k)
            parts = [(r.src + p, min(step, r.n - p), r.dst + p, 1) for p in range(0, r.n, step)]
        else:  # stripes: whole blocks of the run
            per = -(-r.count // min(k, r.count))
            parts = [
                (r.src + b * r.src_stride, r.n, r.dst + b * r.dst_stride, min(per, r.count - b))
                for b in range(0, r.count, per)
            ]
        for i, (src, n, dst, count) in enumerate(parts):
            out.append(
                WriteOp(
                    src_offset=src,
                    length=n,
                    dst_node=node,
                    dst_region=region,
                    dst_offset=dst,
                    slot=slots[rank],
                    dst_rank=rank,
                    lane=(len(out) + i) % src_lanes if len(parts) == 1 else i % src_lanes,
                    src_region=src_region,
                    count=count,
                    src_stride=r.src_stride if count > 1 else 0,
                    dst_stride=r.dst_stride if count > 1 else 0,
                )
            )
    return out


def _chunks(sends: list[Send], cap: int) -> list[tuple[int, int, int, Target]]:
    """(src, n, dst, target) of every chunk: sends merged where contiguous at both ends,
    then cut at `cap` bytes."""
    order = sorted(
        sends,
        key=lambda s: (s.dst_node, s.dst_rank, s.dst_region, s.pack.region, s.pack.offset),
    )
    merged: list[list[int]] = []  # [src, length, dst]
    targets: list[Target] = []
    for s in order:
        target = (s.dst_node, s.dst_rank, s.dst_region, s.pack.region)
        if merged and targets[-1] == target:
            src, length, dst = merged[-1]
            if src + length == s.pack.offset and dst + length == s.dst_offset:
                merged[-1][1] += s.nbytes
                continue
        merged.append([s.pack.offset, s.nbytes, s.dst_offset])
        targets.append(target)
    return [
        (src + start, min(cap, length - start), dst + start, target)
        for (src, length, dst), target in zip(merged, targets, strict=True)
        for start in range(0, length, cap)
    ]


def _runs(chunks: list[tuple[int, int, int, Target]], cap: int) -> list[_Run]:
    """Chunks of one target and size, in source order, gathered while they stay evenly
    spaced at both ends (and the run within `cap` bytes)."""
    runs: list[_Run] = []
    open_runs: dict[tuple[Target, int], _Run] = {}
    for src, n, dst, target in sorted(chunks, key=lambda c: (c[3], c[1], c[0])):
        run = open_runs.get((target, n))
        if run is None or not run.extend(src, dst, cap):
            run = open_runs[(target, n)] = _Run(src, n, dst, target)
            runs.append(run)
    return runs
