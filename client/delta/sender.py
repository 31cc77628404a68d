"""The trainer half of delta sync: compare each bucket with the bytes last sent, encode
payloads and trailers into the rank's delta-out region (what each trailer says: `trailers.py`),
and track what each engine holds.

Memory: one **shadow** of the whole send at its planned staging offsets
(`RankPlan.shadow_bytes`, whatever the staging ring holds at a time), on the staging's
device (GPU memory for GPU staging, host memory for the CPU replica): the bytes of the
last version this rank packed, the same for every destination. A destination gets
a delta only when it verifiably holds that version (its last verdict); otherwise it gets
the bucket dense. After each bucket the shadow takes the new bytes: a scatter of the
changes where a delta was computed, a copy elsewhere. On the host path, which slots are
compared and in which unit (bytes or elements) is `hostclaims`' choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch
import xxhash

from weightwire.protocol.local import PublishResult
from weightwire.protocol.plan import Bucket, DeltaSlot, RankPlan

from . import codec, digest, frames, hostpass, scan
from .hostclaims import HOST_KINDS, HostClaims, Mode
from .inplace import InPlace, Planned
from .replan import unchanged
from .trailers import Dst, SourceBytes, Trailers, src_blocks

__all__ = ["DeltaSender", "Mode"]


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
        self.host = HostClaims()  # the host path's compare choices

    @property
    def sampled(self) -> int:
        """Delta slots of the last version that were sampled before their compare."""
        return self.host.sampled

    @property
    def shadow_bytes(self) -> int:
        return 0 if self.shadow is None else self.shadow.numel()

    def begin(self, version: int, plan: RankPlan, staging: torch.Tensor | None) -> None:
        if plan.plan_hash != self.plan_hash:  # a replan: whose bytes are still known?
            kept = unchanged(self._plan, plan, self.held) if self.shadow is not None else {}
            self.plan_hash, self.held = plan.plan_hash, kept
            self.host.forget()  # another plan's buckets and slots
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
        self._changed = self._compared = 0
        self.host.begin()
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
        jobs = self.host.claims(b, new, shadow, self._wants_delta, self.mode)
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
        self.host.learn(b.index, jobs.values())
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
                self.host.sent(b.index, index, job)
        self.host.done(jobs.values())
        return sent

    def _tick(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

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
        changed, compared = self._changed + self.host.changed, self._compared + self.host.compared
        self.last_density = changed / compared if compared else 0.0
        self.last_compared = compared
        return tuple(lengths)

    def settle(self, version: int, plan: RankPlan, result: PublishResult | None) -> None:
        """What each engine rank holds after `version`: only those that verified it."""
        verdicts = {(v.node, v.slot): v.ok for v in (result.verdicts if result else ())}
        for t in plan.trailers:
            dst = (t.dst_node, t.slot)
            self.held[dst] = version if verdicts.get(dst) else -1

    def abandon(self) -> None:
        """The version failed on this side: the shadow may be half moved on."""
        self.shadow_version, self.held = -1, {}  # everything dense next
        self.host.forget()


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat, through numpy on the CPU (several times faster there)."""
    if not parts:
        return torch.zeros(0, dtype=dtype)
    if len(parts) == 1:
        return parts[0]
    if parts[0].device.type == "cpu":
        return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
    return torch.cat(parts)
