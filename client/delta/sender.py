"""The trainer half of delta sync: compare each bucket with the bytes last sent, encode
payloads and trailers into the rank's delta-out region (what each trailer says: `trailers.py`),
and track what each engine holds.

Memory: one **shadow** of the whole send at its planned staging offsets
(`RankPlan.shadow_bytes`, whatever the staging ring holds at a time), on the staging's
device (GPU memory for GPU staging, host memory for the CPU replica): the bytes of the
last version this rank packed, the same for every destination. A destination gets
a delta only when it verifiably holds that version (its last verdict); otherwise it gets
the bucket dense. After each bucket the shadow takes the new bytes: a scatter of the
changes where a delta was computed, a copy elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import xxhash

from weightwire.protocol.local import PublishResult
from weightwire.protocol.plan import Bucket, DeltaSlot, RankPlan

from . import codec, digest, frames, hostpass, scan
from .inplace import InPlace, Planned
from .replan import unchanged
from .trailers import Dst, SourceBytes, Trailers, src_blocks

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
say otherwise (`DeltaSender._unit_of`): bytes. A payload says its width, so the engine
applies bytes as it applies FP8 codes. A bf16 element that Adam moves by an ULP or a few
changes in its low byte only (the high byte, sign and seven exponent bits, about once in
256 ULP steps), so a changed element costs 2 bytes of position and 1 of value instead of
2 and 2: 25 % fewer bytes at RL learning rates; the compare is no slower (bound by
memory either way). Where updates are large enough to change both bytes, a changed
element would cost 6 bytes instead of 4, and the bucket compares elements. The stats
count elements either way (`scan.Changes.pairs`)."""


class DeltaSender:
    def __init__(self, mode: Mode = "auto") -> None:
        if mode not in ("off", "auto", "on"):
            raise ValueError(f"delta mode {mode!r}: use off, auto or on")
        self.mode: Mode = mode
        self.plan_hash = ""
        self.shadow: torch.Tensor | None = None
        self.shadow_version = -1  # the version the shadow holds (-1: none, everything dense)
        self.held: dict[Dst, int] = {}  # what each engine rank verifiably holds
        self._plan: RankPlan | None = None
        self._version = -1
        self._trailers = Trailers()  # what this version's trailers will say
        self._base = -1
        self.last_density = 0.0  # changed elements / compared, of the last version
        self.last_compared = 0  # elements compared with the shadow, in the last version
        self._changed = 0
        self._compared = 0
        self.phases: dict[str, float] = {}  # seconds of the last version, by phase (host path)
        self._spare: list[scan.Buffers] = []  # host compare buffers, reused bucket to bucket
        # (bucket, slot index) -> changes / limit of the slot's payload, where it went delta
        # the last time it was compared (the host path; see SKIP_FILL)
        self._fill: dict[tuple[int, int], float] = {}
        self._unit: dict[int, int] = {}  # bucket -> the unit its 2-byte slots compared in
        self.sampled = 0  # delta slots of the last version that were sampled first

    @property
    def shadow_bytes(self) -> int:
        return 0 if self.shadow is None else self.shadow.numel()

    def begin(self, version: int, plan: RankPlan, staging: torch.Tensor | None) -> None:
        if plan.plan_hash != self.plan_hash:  # a replan: whose bytes are still known?
            kept = unchanged(self._plan, plan, self.held) if self.shadow is not None else {}
            self.plan_hash, self.held = plan.plan_hash, kept
            self._fill, self._unit = {}, {}  # another plan's buckets and slots
            if not kept:
                self.shadow_version, self.shadow = -1, None
        self._plan = plan
        if self.shadow is None and plan.trailers:
            device = staging.device if staging is not None else torch.device("cpu")
            self.shadow = torch.zeros(plan.shadow_bytes, dtype=torch.uint8, device=device)
            if device.type == "cpu" and self.mode != "off":
                scan.warm()
        self._trailers.begin(plan)
        self._version = version
        self._base = self.shadow_version
        self._changed = self._compared = self.sampled = 0
        self.phases = {"sample": 0.0, "scan": 0.0, "copy": 0.0, "encode": 0.0}

    def in_place(
        self, b: Bucket, staging: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]
    ) -> InPlace | None:
        """Bucket b's bytes where its tensors hold them, when the host pass may compare
        them there before (or instead of) packing: host staging and shadow, a delta
        wanted for some destination, plain copies of contiguous boxes (`inplace`)."""
        if staging is None or staging.device.type != "cpu" or self.shadow is None:
            return None
        if self.shadow.device.type != "cpu" or not any(self._wants_delta(d) for d in b.deltas):
            return None
        return InPlace.of(b, tensors)

    def _wants_delta(self, ds: DeltaSlot) -> bool:
        return (
            self.mode != "off"
            and self._base >= 0
            and self.held.get((ds.dst_node, ds.slot), -1) == self._base
        )

    def bucket(
        self,
        b: Bucket,
        staging: torch.Tensor | None,
        shift: int,
        out: torch.Tensor | None,
        source_bytes: SourceBytes,
        gpu_region: Callable[[str, int], bool],
        in_place: InPlace | None = None,
    ) -> list[tuple[int, int, int]]:
        """Bucket b is packed in `staging` at its planned offsets + `shift` (its ring slot),
        or, with `in_place` (host staging and shadow), not yet: its bytes are read from
        the tensors it is packed from. Checksum what it writes to engines with trailers,
        encode its payloads into `out`, and move the shadow on (all before its slot is
        reused). Returns (bucket, delta slot, payload bytes) of the payloads to send."""
        if out is None or self.shadow is None:
            return []
        if (
            staging is not None
            and staging.device.type == "cpu"
            and self.shadow.device.type == "cpu"
        ):
            new = in_place if in_place is not None else Planned(staging, shift)
            return self._bucket_host(b, new, out, source_bytes, gpu_region)
        self._trailers.checksum(b, staging, shift, source_bytes, gpu_region)
        if staging is None:
            return []
        new = Planned(staging, shift)
        found: dict[tuple[int, int, int], torch.Tensor] = {}  # (offset, length, width) -> pos
        sent: list[tuple[int, int, int]] = []
        for index, ds in enumerate(b.deltas):
            if not self._wants_delta(ds):
                continue
            into_host = any(
                not gpu_region(b.writes[i].dst_node, b.writes[i].dst_region) for i in ds.writes
            )  # a host engine applies BLOCK16 compiled, BITMAP slowly
            kinds = HOST_KINDS if into_host else codec.SPARSE
            nbytes = self._encode(b, ds, new, out, found, kinds)
            if nbytes:
                sent.append((b.index, index, nbytes))
                self._trailers.sent(ds, nbytes)
        self._advance(b, new, found)
        return sent

    def _bucket_host(
        self,
        b: Bucket,
        new: Planned | InPlace,
        out: torch.Tensor,
        source_bytes: SourceBytes,
        gpu_region: Callable[[str, int], bool],
    ) -> list[tuple[int, int, int]]:
        """`bucket` for host staging and shadow: one pass over the staging the bucket
        reads (`hostpass`): each byte compared once where a payload may go (copied into
        the shadow elsewhere) and hashed on the way; a payload's compare stops as soon as
        it could not fit (or, by a sampled estimate, before it starts)."""
        assert self.shadow is not None
        shadow = self.shadow.numpy()
        t0 = time.perf_counter()
        jobs = self._claims(b, new, shadow)
        self._tick("sample", t0)
        hashed = [self._trailers.hashed(wr) for wr in b.writes]
        gpu = [
            h and gpu_region(wr.dst_node, wr.dst_region)
            for h, wr in zip(hashed, b.writes, strict=True)
        ]
        hashers = {
            i: xxhash.xxh3_64()
            for i, wr in enumerate(b.writes)
            if hashed[i] and not gpu[i] and wr.src_region < 0
        }
        done = hostpass.run(b, new, shadow, list(jobs.values()), hashers)
        self._learn_unit(b.index, jobs.values())
        self._changed += done.changed
        self._compared += done.compared
        self.phases["scan"] += done.scan_s
        self.phases["copy"] += done.copy_s
        for i, wr in enumerate(b.writes):
            if not hashed[i]:
                continue
            if i in hashers:
                part = hashers[i].intdigest()
            else:  # a GPU destination (tdigest) or a zero-copy source
                blocks = [
                    source_bytes(wr.src_region, off, length)
                    if wr.src_region >= 0
                    else new[off : off + length]
                    for off, length in src_blocks(wr)
                ]
                part = digest.range_digest(blocks, gpu[i])
            self._trailers.add(wr, part)
        sent: list[tuple[int, int, int]] = []
        for index, job in jobs.items():
            t0 = time.perf_counter()
            nbytes = 0 if job.dense else self._payload(b, job, out)
            self._tick("encode", t0)
            if nbytes:
                ds = job.slot
                sent.append((b.index, index, nbytes))
                self._trailers.sent(ds, nbytes)
                self._fill[(b.index, index)] = job.changes.k / max(1, job.changes.limit)
        kept = [job.changes.buffers() for job in jobs.values() if not job.dense]
        self._spare = sorted(self._spare + kept, key=lambda s: s.low.size)[-SPARES:]
        return sent

    def _tick(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

    def _claims(
        self, b: Bucket, new: Planned | InPlace, shadow: np.ndarray
    ) -> dict[int, hostpass.Job]:
        """Compare jobs for bucket b's delta slots that may go delta (by index): each
        sampled first unless its last payload went delta well inside its limit
        (`SKIP_FILL`), all compared in one unit (`_unit_of`)."""
        looks: dict[int, _Look] = {}
        for index, ds in enumerate(b.deltas):
            if self._wants_delta(ds):
                fill = self._fill.pop((b.index, index), 1.0)
                look = self._look(b, ds, new, shadow, sample=fill > SKIP_FILL)
                if look is not None:
                    looks[index] = look
        unit = self._unit_of(b.index, looks.values())
        jobs = {}
        for index, look in looks.items():
            job = self._claim(look, unit if look.slot.width == 2 else 1)
            if job is not None:
                jobs[index] = job
        return jobs

    def _look(
        self, b: Bucket, ds: DeltaSlot, new: Planned | InPlace, shadow: np.ndarray, sample: bool
    ) -> _Look | None:
        """Slot `ds`'s blocks, and its density sampled by bytes and by elements if
        `sample`; None when it goes dense (a block not aligned to its elements)."""
        look = _Look(
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

    def _unit_of(self, bucket: int, looks: Iterable[_Look]) -> int:
        """What a bucket's 2-byte slots compare and encode: bytes (`HOST_UNIT`) or
        elements, whichever the sampled slots' BLOCK16 bodies say is smaller (an element
        changed in both bytes costs 6 bytes as bytes, 4 as an element); unsampled, what
        the bucket's last compare found (`_learn_unit`), bytes at first."""
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
            self._unit[bucket] = 1 if size[1] <= size[2] else 2
        return self._unit.get(bucket, HOST_UNIT)

    def _learn_unit(self, bucket: int, jobs: Iterable[hostpass.Job]) -> None:
        """The unit a bucket's next compare uses, by what its 2-byte slots' compare found
        (`scan.Changes.pairs`: elements changed in both bytes): bytes unless elements
        would have cost less."""
        as_bytes = as_elements = 0
        for job in jobs:
            ch = job.changes
            if job.slot.width != 2 or not ch.k:
                continue
            pairs = int(ch.pairs[0])
            changed = (ch.k - pairs, ch.k) if ch.width == 1 else (ch.k, ch.k + pairs)
            as_elements, as_bytes = as_elements + changed[0], as_bytes + changed[1]
        if as_bytes:
            self._unit[bucket] = 1 if 3 * as_bytes <= 4 * as_elements else 2

    def _claim(self, look: _Look, w: int) -> hostpass.Job | None:
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
            dense_is_smaller = self.mode == "auto" and size >= n * w
            if size > SAMPLE_MARGIN * room or dense_is_smaller:
                self._changed += look.changed[ds.width]  # the stats count elements
                self._compared += look.compared[ds.width]
                return None
        starts, start = [], 0
        for off, length, i in look.blocks:
            starts.append((off, length, start, i))
            start += length // w
        spare = self._spare.pop() if self._spare else None
        return hostpass.Job(ds, n, scan.Changes(n, w, limit, spare=spare), starts)

    def _head(
        self, b: Bucket, ds: DeltaSlot, n: int, k: int, kinds: tuple[codec.Kind, ...], w: int
    ) -> frames.PayloadHead | None:
        """The head of the payload of `k` changed of `n` elements of `w` bytes for `ds`,
        encoded as the smallest of `kinds`; None when it goes dense (dense is as small, or
        it does not fit in the slot or in the writes it has)."""
        kind = codec.best_kind(n, k, w, allow_dense=self.mode != "on", kinds=kinds)
        blocks = tuple(
            (wr.dst_region, wr.dst_offset, wr.length, wr.count, wr.dst_stride)
            for wr in (b.writes[i] for i in ds.writes)
        )
        body_len = codec.body_size(kind, n, k, w)
        head = frames.PayloadHead(int(kind), w, self._version, self._base, n, k, body_len, blocks)
        if kind is codec.Kind.DENSE or head.size > ds.capacity or head.size < len(ds.writes):
            return None
        return head

    def _payload(self, b: Bucket, job: hostpass.Job, out: torch.Tensor) -> int:
        """Encode a job's changes into `out`; its bytes (0: it goes dense)."""
        ds, n, ch = job.slot, job.elements, job.changes
        head = self._head(b, ds, n, ch.k, HOST_KINDS, ch.width)
        if head is None:
            return 0
        kind = codec.Kind(head.kind)
        at = ds.src_offset
        dst = out.numpy()
        dst[at : at + head.body_offset] = np.frombuffer(frames.payload_head(head), np.uint8)
        body = dst[at + head.body_offset : at + head.size]
        codec.encode_blocks_into(body, ch.counts, ch.low[: ch.k], ch.values, n, kind)
        return head.size

    def _encode(
        self,
        b: Bucket,
        ds: DeltaSlot,
        staging: Planned,
        out: torch.Tensor,
        found: dict[tuple[int, int, int], torch.Tensor],
        kinds: tuple[codec.Kind, ...],
    ) -> int:
        """The payload for `ds` at its offset in `out` (the smallest of `kinds`); 0 when it
        goes dense."""
        assert self.shadow is not None
        w = ds.width
        writes = [b.writes[i] for i in ds.writes]
        positions, values, start = [], [], 0
        for off, length in (blk for wr in writes for blk in src_blocks(wr)):
            key = (off, length, w)
            pos = found.get(key)
            if pos is None:
                pos = found[key] = codec.changes(
                    staging[off : off + length], self.shadow[off : off + length], w
                )
                self._changed += pos.numel()
                self._compared += length // w
            positions.append(pos + start // w)
            values.append(codec.values_at(staging[off : off + length], pos, w))
            start += length
            changed = sum(int(p.numel()) for p in positions)
            if changed * (w + 0.125) > ds.capacity:  # cannot fit: dense, and stop early
                return 0
        n = start // w
        pos = _cat(positions, torch.int64)
        head = self._head(b, ds, n, int(pos.numel()), kinds, w)
        if head is None:
            return 0
        body = codec.encode_body(pos, _cat(values, torch.uint8), n, w, codec.Kind(head.kind))
        at = ds.src_offset
        raw = torch.frombuffer(bytearray(frames.payload_head(head)), dtype=torch.uint8)
        out[at : at + raw.numel()].copy_(raw)
        out[at + head.body_offset : at + head.size].copy_(body)
        return head.size

    def _advance(
        self, b: Bucket, staging: Planned, found: dict[tuple[int, int, int], torch.Tensor]
    ) -> None:
        """The shadow takes the bucket's new bytes."""
        assert self.shadow is not None
        done: set[tuple[int, int]] = set()
        by_range = {(off, length): (pos, w) for (off, length, w), pos in found.items()}
        for wr in b.writes:
            if wr.src_region >= 0:
                continue
            for off, length in src_blocks(wr):
                if (off, length) in done:
                    continue
                done.add((off, length))
                new, old = staging[off : off + length], self.shadow[off : off + length]
                hit = by_range.get((off, length))
                if hit is None:
                    old.copy_(new)
                else:
                    pos, w = hit
                    codec.scatter(old, pos, codec.values_at(new, pos, w), w)

    def trailers(self, plan: RankPlan, out: torch.Tensor) -> tuple[int, ...]:
        """Write each trailer into `out`; their lengths. Call after every bucket."""
        lengths = self._trailers.write(plan, self._version, self._base, out)
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        self.shadow_version = self._version if self.shadow is not None else -1
        self.last_density = self._changed / self._compared if self._compared else 0.0
        self.last_compared = self._compared
        return tuple(lengths)

    def settle(self, version: int, plan: RankPlan, result: PublishResult | None) -> None:
        """What each engine rank holds after `version`: only those that verified it."""
        verdicts = {(v.node, v.slot): v.ok for v in (result.verdicts if result else ())}
        for t in plan.trailers:
            dst = (t.dst_node, t.slot)
            self.held[dst] = version if verdicts.get(dst) else -1

    def abandon(self) -> None:
        """The version failed on this side: the shadow may be half moved on."""
        self.shadow_version, self.held, self._fill = -1, {}, {}  # everything dense next
        self._unit = {}


@dataclass
class _Look:
    """A delta slot before its compare: its source blocks (staging offset, length, write
    index) and, if sampled, the changes and the units compared by unit width."""

    slot: DeltaSlot
    blocks: list[tuple[int, int, int]]
    changed: dict[int, int] = field(default_factory=dict)
    compared: dict[int, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(length for _, length, _ in self.blocks)


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat, through numpy on the CPU (several times faster there)."""
    if not parts:
        return torch.zeros(0, dtype=dtype)
    if len(parts) == 1:
        return parts[0]
    if parts[0].device.type == "cpu":
        return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
    return torch.cat(parts)
