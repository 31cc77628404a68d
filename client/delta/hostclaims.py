"""Which of a host bucket's delta slots are compared, and how: the sender's choices before
its host pass (`hostpass`), and what it learns from each pass for the next version.

Per bucket, each slot that may go delta is looked at first: its blocks, and a density
sampled from a few windows unless its last payload went delta well inside its limit
(`SKIP_FILL`). A slot whose sample says its payload would not fit (or, in `auto`, would
be no smaller than dense) goes dense without a compare. The others become compare jobs,
all of one bucket in one **unit**: bytes (`HOST_UNIT`) or the slot's 2-byte elements,
whichever the samples, or else the bucket's last compare, say is cheaper. Their change
buffers are reused from bucket to bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from weightwire.protocol.plan import Bucket, DeltaSlot

from . import codec, frames, hostpass, scan
from .inplace import InPlace, Planned
from .trailers import src_blocks

Mode = Literal["off", "auto", "on"]
SAMPLE_MARGIN = 1.0
"""A slot goes dense without a full compare when its sampled density gives a payload this
many times its capacity (a wrong guess costs bytes, never correctness)."""
SKIP_FILL = 0.5
"""A slot skips the sampling pass when, the last time it was compared (the last delta
version; dense versions in between, `off` or to a destination that lost its base, leave
it be), it went delta with at most this fraction of the changes that fit (its `limit`).
The compare stops at the limit anyway, so a wrong guess costs a compare up to it and a
dense payload, never correctness. A slot that went dense, or came closer to its limit,
is sampled first."""
SPARES = 4
"""Host compare buffers kept for the next bucket's payloads (the largest): a payload's
changes go into memory already paged in (bounded by a few payloads' capacity)."""
HOST_KINDS = (codec.Kind.POS32, codec.Kind.BLOCK16)
"""The host path's encodings: BLOCK16, compiled at both ends, and POS32 (a few changes).
BITMAP took 0.28 s to encode and 0.9 s to decode per 256 MiB bucket at 18 % density, a
version slower than dense: where BLOCK16 cannot fit, the slot goes dense."""
HOST_UNIT = 1
"""What the host path compares and encodes for 2-byte elements, unless a bucket's samples
say otherwise (`HostClaims.unit_of`): bytes. A payload says its width, so the engine
applies bytes as it applies FP8 codes. A bf16 element that Adam moves by an ULP or a few
changes in its low byte only (the high byte, sign and seven exponent bits, about once in
256 ULP steps), so a changed element costs 2 bytes of position and 1 of value instead of
2 and 2: 25 % fewer bytes at RL learning rates; the compare is no slower (bound by
memory either way). Where updates are large enough to change both bytes, a changed
element would cost 6 bytes instead of 4, and the bucket compares elements. The stats
count elements either way (`scan.Changes.pairs`)."""


@dataclass
class Look:
    """A delta slot before its compare: its source blocks (staging offset, length, write
    index) and, if sampled, the changes and the units compared by unit width."""

    slot: DeltaSlot
    blocks: list[tuple[int, int, int]]
    changed: dict[int, int] = field(default_factory=dict)
    compared: dict[int, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(length for _, length, _ in self.blocks)


class HostClaims:
    """The host path's compare choices of one sender rank, kept from version to version
    under one plan (`forget` on another)."""

    def __init__(self) -> None:
        # (bucket, slot index) -> changes / limit of the slot's payload, where it went delta
        # the last time it was compared (see SKIP_FILL)
        self.fill: dict[tuple[int, int], float] = {}
        self.unit: dict[int, int] = {}  # bucket -> the unit its 2-byte slots compared in
        self._spare: list[scan.Buffers] = []  # compare buffers, reused bucket to bucket
        self.sampled = 0  # delta slots of this version that were sampled first
        self.changed = 0  # elements changed and compared in samples of slots that went dense
        self.compared = 0

    def forget(self) -> None:
        """Another plan's buckets and slots, or a shadow that may be half moved on."""
        self.fill, self.unit = {}, {}

    def begin(self) -> None:
        self.sampled = self.changed = self.compared = 0

    def claims(
        self,
        b: Bucket,
        new: Planned | InPlace,
        shadow: np.ndarray,
        wants_delta: Callable[[DeltaSlot], bool],
        mode: Mode,
    ) -> dict[int, hostpass.Job]:
        """Compare jobs for bucket b's delta slots that may go delta (by index): each
        sampled first unless its last payload went delta well inside its limit
        (`SKIP_FILL`), all compared in one unit (`unit_of`)."""
        looks: dict[int, Look] = {}
        for index, ds in enumerate(b.deltas):
            if wants_delta(ds):
                fill = self.fill.pop((b.index, index), 1.0)
                look = self._look(b, ds, new, shadow, sample=fill > SKIP_FILL)
                if look is not None:
                    looks[index] = look
        unit = self.unit_of(b.index, looks.values())
        jobs = {}
        for index, look in looks.items():
            job = self._claim(look, unit if look.slot.width == 2 else 1, mode)
            if job is not None:
                jobs[index] = job
        return jobs

    def _look(
        self, b: Bucket, ds: DeltaSlot, new: Planned | InPlace, shadow: np.ndarray, sample: bool
    ) -> Look | None:
        """Slot `ds`'s blocks, and its density sampled by bytes and by elements if
        `sample`; None when it goes dense (a block not aligned to its elements)."""
        look = Look(
            ds, [(off, length, i) for i in ds.writes for off, length in src_blocks(b.writes[i])]
        )
        self.sampled += sample
        for off, length, _ in look.blocks:
            for at, piece in new.pieces(off, length):
                a, old = piece.numpy(), shadow[at : at + piece.numel()]
                if not scan.aligned(a, old, ds.width):
                    return None
                if sample:
                    for w in {1, ds.width}:
                        c, m = scan.sample(a, old, w)
                        look.changed[w] = look.changed.get(w, 0) + c
                        look.compared[w] = look.compared.get(w, 0) + m
        return look

    def unit_of(self, bucket: int, looks: Iterable[Look]) -> int:
        """What a bucket's 2-byte slots compare and encode: bytes (`HOST_UNIT`) or
        elements, whichever the sampled slots' BLOCK16 bodies say is smaller (an element
        changed in both bytes costs 6 bytes as bytes, 4 as an element); unsampled, what
        the bucket's last compare found (`learn`), bytes at first."""
        size = {1: 0.0, 2: 0.0}
        sampled = False
        for look in looks:
            if look.slot.width != 2 or not look.compared.get(2):
                continue
            sampled = True
            n = look.bytes // 2
            for w in (1, 2):
                k = look.changed[w] * (n * 2 // w) / look.compared[w]
                size[w] += codec.body_size(codec.Kind.BLOCK16, n * 2 // w, int(k), w)
        if sampled:
            self.unit[bucket] = 1 if size[1] <= size[2] else 2
        return self.unit.get(bucket, HOST_UNIT)

    def _claim(self, look: Look, w: int, mode: Mode) -> hostpass.Job | None:
        """A compare job for `look`'s slot in units of `w` bytes; None when it goes dense:
        a sampled density that would not fit, or dense no larger."""
        ds = look.slot
        n = look.bytes // w
        room = ds.capacity - frames.body_offset(len(ds.writes))
        limit = codec.max_changes(n, w, room, HOST_KINDS)  # more changes than this cannot fit
        if limit < 0:
            return None
        compared = look.compared.get(w, 0)
        if compared and compared < n:  # sampled: go dense unless it may well fit
            estimate = look.changed[w] * n // compared
            kind = codec.best_kind(n, estimate, w, allow_dense=False, kinds=HOST_KINDS)
            size = codec.body_size(kind, n, estimate, w)
            dense_is_smaller = mode == "auto" and size >= n * w
            if size > SAMPLE_MARGIN * room or dense_is_smaller:
                self.changed += look.changed[ds.width]  # the stats count elements
                self.compared += look.compared[ds.width]
                return None
        starts, start = [], 0
        for off, length, i in look.blocks:
            starts.append((off, length, start, i))
            start += length // w
        spare = self._spare.pop() if self._spare else None
        return hostpass.Job(ds, n, scan.Changes(n, w, limit, spare=spare), starts)

    def learn(self, bucket: int, jobs: Iterable[hostpass.Job]) -> None:
        """After a bucket's pass: the unit its next compare uses, by what its 2-byte
        slots' compare found (`scan.Changes.pairs`: elements changed in both bytes),
        bytes unless elements would have cost less."""
        as_bytes = as_elements = 0
        for job in jobs:
            ch = job.changes
            if job.slot.width != 2 or not ch.k:
                continue
            elements, nbytes = scan.two_byte_counts(ch.k, int(ch.pairs[0]), ch.width)
            as_elements, as_bytes = as_elements + elements, as_bytes + nbytes
        if as_bytes:
            self.unit[bucket] = 1 if 3 * as_bytes <= 4 * as_elements else 2

    def sent(self, bucket: int, index: int, job: hostpass.Job) -> None:
        """Slot `index`'s payload went delta: how full it was (see SKIP_FILL)."""
        self.fill[(bucket, index)] = job.changes.k / max(1, job.changes.limit)

    def done(self, jobs: Iterable[hostpass.Job]) -> None:
        """The bucket's payloads are encoded: their buffers are the next bucket's."""
        kept = [job.changes.buffers() for job in jobs if not job.dense]
        self._spare = sorted(self._spare + kept, key=lambda s: s.low.size)[-SPARES:]
