"""The sender's host pass over one bucket: every staging byte compared with the shadow
exactly once, in staging order, however the bucket's writes share or overlap it.

A bucket's writes may read the same staging bytes: a norm staged once and written whole
to two TP engine ranks, or one rank's coalesced write spanning a tensor that another
rank gets in separate blocks. The shadow moves on as bytes are compared, so bytes
compared a second time would show no changes at all; and a payload's positions must
come out in its stream's order whatever order the writes visit its blocks in. So the
pass cuts the staging the bucket's writes read at every block's edges into disjoint
**segments** and walks them in staging order. Each segment is compared once (or copied
into the shadow where no payload needs it), and fed to the checksum of every write that
reads it while it is in cache. Its changes go:

- straight into the payload's buffers when one payload needs the segment and that
  payload's blocks lie in ascending staging order (the common case: no copy at all);
- otherwise into a segment-sized buffer, then into each payload that needs them:
  appended in order when its blocks ascend, kept as pieces and put in stream order at
  the end when they do not.

A payload whose changes cannot be known exactly (a segment split off an element, a
width other payloads of the segment do not share, too many changes) goes dense; the
shadow and the checksums are right either way.
"""

from __future__ import annotations

import bisect
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightwire.protocol.plan import Bucket, DeltaSlot

from . import scan

THREADS = 2 if (os.cpu_count() or 1) >= 4 else 1
"""Threads one segment's compare may use (1: the caller's only; see `_scan_split`). A
helper only where the host has cores to spare: the compare is bound by memory, and on
2 cores the helper took the core the daemons and a colocated engine need (the 2-core
development VM: 0.16 s per 1.07 GB delta version with 1 thread, 0.20 s with 2)."""
SPLIT_BYTES = 4 << 20  # segments from this size up are split between two threads
_pool: ThreadPoolExecutor | None = None


@dataclass
class Job:
    """One delta slot's compare: its stream's blocks (staging offset, length, element
    start, write index) in stream order, and the changes found so far."""

    slot: DeltaSlot
    elements: int
    changes: scan.Changes
    blocks: list[tuple[int, int, int, int]]
    dense: bool = False
    pieces: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def direct(self) -> bool:
        """Its blocks ascend in staging without overlap: a walk in staging order finds
        its changes in stream order."""
        return all(a[0] + a[1] <= b[0] for a, b in zip(self.blocks, self.blocks[1:], strict=False))

    def give_up(self) -> None:
        """It goes dense: its buffers go."""
        self.dense = True
        self.changes = scan.Changes(0, self.changes.width, 0)
        self.pieces = []

    def finish(self) -> None:
        """Pieces (a job whose blocks do not ascend in staging) into stream order."""
        if self.dense or not self.pieces:
            return
        acc = self.changes
        total = acc.k + sum(p.size for _, p, _ in self.pieces)
        if total > acc.limit:
            self.give_up()
            return
        for _, pos, val in sorted(self.pieces, key=lambda p: p[0]):
            acc.append(pos, val)
        self.pieces = []


@dataclass
class Pass:
    """Counts and seconds of one bucket's pass: elements (of each slot's width, however
    they were compared) changed and compared."""

    changed: int = 0
    compared: int = 0
    scan_s: float = 0.0
    copy_s: float = 0.0


def segments(
    blocks: list[tuple[int, int]], cuts: tuple[int, ...] = ()
) -> list[tuple[int, int, list[int]]]:
    """(start, end, indices of the blocks that cover it) of each disjoint piece of the
    bytes that `blocks` ((offset, length)) cover, in ascending order, also cut at `cuts`."""
    edges = sorted({e for off, length in blocks for e in (off, off + length)} | set(cuts))
    cover: dict[int, list[int]] = {}
    for i, (off, length) in enumerate(blocks):
        lo = bisect.bisect_left(edges, off)
        hi = bisect.bisect_left(edges, off + length)
        for s in range(lo, hi):
            cover.setdefault(s, []).append(i)
    return [(edges[s], edges[s + 1], cover[s]) for s in sorted(cover)]


def run(
    b: Bucket,
    new: Any,
    shadow: np.ndarray,
    jobs: list[Job],
    hashers: dict[int, Any],
) -> Pass:
    """Compare bucket b's staging bytes (`new[lo:hi]`: planned offsets, never across one of
    `new.cuts` where it has them: see `inplace`) with `shadow`,
    move the shadow on, feed `hashers` (write index -> xxh3 of its staging blocks) and
    fill each job's changes (or mark it dense)."""
    blocks: list[tuple[int, int, int]] = []  # (offset, length, write index)
    for i, wr in enumerate(b.writes):
        if wr.src_region < 0:
            blocks += [(wr.src_offset + j * wr.src_stride, wr.length, i) for j in range(wr.count)]
    start_of: dict[tuple[int, int], tuple[Job, int]] = {}
    for job in jobs:
        for off, _, start, i in job.blocks:
            start_of[(i, off)] = (job, start)
    direct = {id(job): job.direct for job in jobs}
    stats = Pass()
    cuts: tuple[int, ...] = getattr(new, "cuts", ())
    for lo, hi, cover in segments([(off, length) for off, length, _ in blocks], cuts):
        a, old = new[lo:hi].numpy(), shadow[lo:hi]
        feed = [hashers[i] for _, _, i in (blocks[c] for c in cover) if i in hashers]
        need: list[tuple[Job, int]] = []
        for off, _, i in (blocks[c] for c in cover):
            js = start_of.get((i, off))
            if js is None or js[0].dense:
                continue
            job, start = js
            w = job.changes.width
            if need and w != need[0][0].changes.width:
                job.give_up()  # one compare per segment, at one width
            elif (lo - off) % w or (hi - lo) % w or not scan.aligned(a, old, w):
                job.give_up()
            else:
                need.append((job, start + (lo - off) // w))
        t0 = time.perf_counter()
        if not need:
            scan.copy(a, old, feed)
            stats.copy_s += time.perf_counter() - t0
            continue
        first, base = need[0]
        if len(need) == 1 and direct[id(first)]:
            acc = first.changes
            k0, p0 = acc.k, int(acc.pairs[0])
            fits = _scan_split(a, old, acc, base, feed)
            found, pairs = min(acc.k, acc.limit + 1) - k0, int(acc.pairs[0]) - p0
            if not fits:
                first.give_up()
        else:
            room = max(j.changes.limit - j.changes.k for j, _ in need)
            seg = scan.Changes(a.size // first.changes.width, first.changes.width, room)
            fits = scan.scan(a, old, seg, 0, feed)
            found, pairs = min(seg.k, seg.limit + 1), int(seg.pairs[0])
            for job, at in need:
                _take(job, seg, at, fits, direct[id(job)])
        if first.slot.width == 2:  # the stats count the slot's elements, not compare units
            found = scan.two_byte_counts(found, pairs, first.changes.width)[0]
        stats.changed += found
        stats.compared += a.size // first.slot.width
        stats.scan_s += time.perf_counter() - t0
    for job in jobs:
        job.finish()
    return stats


def _scan_split(new: np.ndarray, old: np.ndarray, acc: scan.Changes, base: int, feed: Any) -> bool:
    """`scan.scan` of a segment, its second half on the helper thread (numba's loop runs
    without the GIL) when the segment is large and a helper is allowed (`THREADS`); the
    checksums are fed the first half as the caller compares it, the second after, in
    order. The second half's changes go after the first's
    (both are in stream order). False when they do not fit."""
    w = acc.width
    size = new.size
    if THREADS < 2 or size < SPLIT_BYTES or not scan.compiled():
        return scan.scan(new, old, acc, base, feed)
    half = size // 2 // 8 * 8  # both halves keep the 8-byte word alignment
    room = acc.limit - acc.k
    second = scan.Changes((size - half) // w, w, room, blocks=acc.counts.size)
    later = _helper().submit(scan.scan, new[half:], old[half:], second, base + half // w, None)
    fits = scan.scan(new[:half], old[:half], acc, base, feed)  # hashed while in cache
    fits = later.result() and fits
    for at in range(half, size, scan.CHUNK):  # then the second half, in order
        scan.feed(feed, new[at : min(size, at + scan.CHUNK)])
    if not fits or acc.k + second.k > acc.limit:
        acc.k = max(acc.k, acc.limit + 1)  # past the limit: the caller sees it go dense
        return False
    acc.extend(second, 0)  # positions in the same stream
    return True


def _helper() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="delta-scan")
    return _pool


def _take(job: Job, seg: scan.Changes, at: int, fits: bool, direct: bool) -> None:
    """A shared segment's changes (positions from 0) into a job, at its element `at`."""
    acc = job.changes
    if not fits or acc.k + seg.k > acc.limit:
        job.give_up()
    elif direct:
        acc.extend(seg, at)
    else:
        job.pieces.append((at, seg.positions + at, seg.val[: seg.k]))
        acc.pairs += seg.pairs
