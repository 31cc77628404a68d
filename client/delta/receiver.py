"""The engine half of delta sync: apply a version's payloads from the delta area into the
registered tensors (a scatter on their device), then check every sender's trailer
checksum against the bytes now there. The engine tracks the version its bytes hold; a
payload against any other base is refused, and a failed check leaves it holding nothing
(its sources send the next version dense).

Bucket by bucket: when a source says every write of one of its buckets landed here
(`ApplyBucket`), that bucket's payloads are applied and its ranges checksummed at once,
while later buckets are still on their way; `ApplyVersion` (every write landed) then
does only what no bucket message covered and checks each trailer, combining the range
checksums in the trailer's order. In host memory a bucket that lands while the one before
is still being applied is applied beside it (two at most: the one before on a helper
thread, this one on the caller's), so a backlog at the version's end (the last, small
buckets landing while a large one is applied) takes both cores, once the sender is done
with its own. From a version's first bucket on, the rank holds no
verified version until that version verifies. A range checksummed early attests its
bytes as they were once its bucket landed and was applied: a byte changed there behind
weightwire's back later is caught by the next version's check (every version checksums
every range it writes, changed or not), as a change after the version's end always was.

What each sender may write here is the plan's, not its own word (`planned.py`): a trailer
or bucket that claims another rank's ranges fails the version (`unauthorized`) before
anything of it is applied. A bucket of a plan this rank was not yet told of (no
`ApplyVersion` of it came yet) is left to the version's end.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.local import Applied, ApplyBucket, ApplyVersion
from weightwire.protocol.plan import check_blocks, span

from . import codec, decodeloop, digest, frames, hostapply
from .planned import Planned, PlanRefused


@dataclass(frozen=True)
class Target:
    """Registered bytes: `nbytes` at `offset` of region `region`, as a flat uint8 tensor."""

    region: int
    offset: int
    nbytes: int
    data: torch.Tensor


@dataclass
class _Early:
    """A version being applied bucket by bucket, before its `ApplyVersion`."""

    version: int
    base: int  # the version the rank held verified when its first bucket came
    planned: Planned | None  # what its plan routes here (a bucket's ranges are among it)
    sums: dict[tuple[int, frames.Range], int] = field(default_factory=dict)
    applied: set[tuple[int, int]] = field(default_factory=set)  # (sender, payload offset)
    nbytes: int = 0
    checked: int = 0  # bytes of the ranges its buckets named (at most what the rank holds)
    error: Exception | None = None
    seconds: float = 0.0  # summed over the threads its buckets were applied on
    lock: threading.Lock = field(default_factory=threading.Lock)  # its fields, two appliers


class ApplyError(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.CHECKSUM) -> None:
        super().__init__(message)
        self.code = code


class DeltaReceiver:
    def __init__(self, rank: int, area: torch.Tensor) -> None:
        self.rank = rank
        self.area = area
        self.region = -1  # the area's region id (set once registered)
        self.held = -1  # the version this rank's bytes verifiably hold
        self._targets: dict[int, list[Target]] = {}
        self._starts: dict[int, list[int]] = {}
        self._ends: dict[int, int] = {}  # region -> the end of its last registered byte
        self._holds = 0  # registered bytes: what one version's ranges can cover at most
        self._early: _Early | None = None
        self._settled = -1  # the last version `apply` answered for
        self._planned: Planned | None = None  # what the last `ApplyVersion`'s plan routes here
        self.early_s = 0.0  # seconds spent on buckets of the last version before its end
        self.early_ranges = 0  # ranges of the last version checksummed as their bucket landed
        self.tail_ranges = 0  # and those checksummed at its end (`ApplyVersion`)
        self.tail_s = 0.0  # seconds `apply` took for the last version (its end)
        self._beside: ThreadPoolExecutor | None = None  # host areas: a bucket applied beside
        self._busy: Future[None] | None = None  # the bucket it applies (if any)
        if area.device.type == "cpu":
            decodeloop.warm()  # compiled (or loaded from numba's cache) before a version
            self._beside = ThreadPoolExecutor(1, thread_name_prefix="delta-bucket")

    def wait_buckets(self) -> None:
        """Return once no bucket is being applied beside (`apply_bucket` may return before
        its bucket is applied; a failure is kept in its version)."""
        if self._busy is not None:
            self._busy.result()
            self._busy = None

    def close(self) -> None:
        if self._beside is not None:
            self._beside.shutdown(wait=True)

    def add_targets(self, targets: list[Target]) -> None:
        for t in targets:
            self._targets.setdefault(t.region, []).append(t)
        for region, ts in self._targets.items():
            ts.sort(key=lambda t: t.offset)
            self._starts[region] = [t.offset for t in ts]
            self._ends[region] = max(t.offset + t.nbytes for t in ts)
        self._holds = sum(t.nbytes for ts in self._targets.values() for t in ts)

    def rename_regions(self, renamed: dict[int, int]) -> None:
        """The daemon restarted and numbered the regions anew."""
        self.wait_buckets()
        self._early, self._settled = None, -1
        old = [t for ts in self._targets.values() for t in ts]
        self._targets, self._starts, self._ends = {}, {}, {}
        self.add_targets(
            [Target(renamed.get(t.region, t.region), t.offset, t.nbytes, t.data) for t in old]
        )

    def pieces(self, region: int, offset: int, length: int) -> list[torch.Tensor]:
        """Registered bytes [offset, offset + length) of `region`, one piece per tensor it
        spans (a write may cover adjacent tensors); never a byte outside a tensor."""
        starts = self._starts.get(region)
        i = bisect.bisect_right(starts, offset) - 1 if starts else -1
        out: list[torch.Tensor] = []
        end = offset + length
        while offset < end:
            t = self._targets[region][i] if 0 <= i < len(self._targets[region]) else None
            if t is None or not t.offset <= offset < t.offset + t.nbytes:
                raise ApplyError(
                    f"region {region} offset {offset}: no registered tensor there "
                    f"({length} bytes written)"
                )
            stop = min(end, t.offset + t.nbytes)
            out.append(t.data[offset - t.offset : stop - t.offset])
            offset, i = stop, i + 1
        return out

    def is_gpu(self, region: int) -> bool:
        ts = self._targets.get(region)
        return ts is not None and bool(ts) and ts[0].data.is_cuda

    def apply_bucket(self, msg: ApplyBucket) -> None:
        """One bucket of a version in progress landed: apply its payloads and checksum its
        ranges now. A failure is kept and reported by `apply` (the version fails)."""
        if msg.version <= self._settled:
            return  # the version was already settled here: a late note
        planned = self._planned
        if msg.plan and (planned is None or planned.plan != msg.plan):
            return  # what its plan routes here is not known yet: the version's end does it
        early = self._early
        if early is None or early.version != msg.version:
            # a version that never ended here (no ApplyVersion) may still be writing on
            # the helper: never beside the next one's bytes
            self.wait_buckets()
            early = self._early = _Early(msg.version, self.held, planned)
            self.held = -1  # its bytes are changing: nothing verified until it verifies
        if early.error is not None:
            return
        if self._beside is not None and (self._busy is None or self._busy.done()):
            self.wait_buckets()
            self._busy = self._beside.submit(self._apply_bucket, early, msg)
        else:  # the helper is busy with the bucket before: this one beside it, here
            self._apply_bucket(early, msg)

    def _apply_bucket(self, early: _Early, msg: ApplyBucket) -> None:
        t0 = time.perf_counter()
        try:
            with early.lock:
                early.checked = self._check_ranges(msg.ranges, early.checked)
            if msg.plan and early.planned is not None:
                early.planned.check(msg.sender, msg.ranges, f"bucket {msg.bucket}")
            ranges = set(msg.ranges)
            hashed = self._host(ranges)
            taken: dict[frames.Range, list[int]] = {}
            for offset, length in msg.payloads:
                if early.base < 0:
                    raise ApplyError(
                        f"sender rank {msg.sender} sent a delta in version {msg.version}; "
                        f"this rank holds no verified version",
                        ErrorCode.STALE_BASE,
                    )
                got = self._payload(msg.version, early.base, offset, length, ranges, hashed)
                for r, value in got.items():
                    taken.setdefault(r, []).append(value)
                with early.lock:
                    early.applied.add((msg.sender, offset))
                    early.nbytes += length
            for r in msg.ranges:
                sums = taken.get(r, ())
                if len(sums) == 1:  # hashed as its payload wrote it
                    value = sums[0]
                else:
                    blocks = digest.range_blocks(self.pieces, r)
                    value = digest.range_digest(blocks, self.is_gpu(r[0]))
                with early.lock:
                    early.sums[(msg.sender, r)] = value
        except Exception as exc:  # reported when the version ends here
            with early.lock:
                early.error = early.error or exc
        with early.lock:
            early.seconds += time.perf_counter() - t0

    def apply(self, msg: ApplyVersion) -> Applied:
        self.wait_buckets()  # every bucket of the version applied first
        t0 = time.perf_counter()
        early = self._early if self._early and self._early.version == msg.version else None
        self._early, self._settled = None, max(self._settled, msg.version)
        self.early_s = early.seconds if early is not None else 0.0
        self.early_ranges = len(early.sums) if early is not None else 0
        self.tail_ranges = 0
        base = early.base if early is not None else self.held
        try:
            if early is not None and early.error is not None:
                raise early.error
            nbytes = self._apply(msg, base, early)
        except Exception as exc:  # whatever it was, the version is not verified here
            self.held = -1
            if isinstance(exc, ApplyError | PlanRefused):
                code = exc.code
            elif isinstance(exc, ValueError):  # FrameError and malformed bodies
                code = ErrorCode.CHECKSUM
            else:
                code = ErrorCode.INTERNAL
            message = str(exc) if code != ErrorCode.INTERNAL else f"applying failed: {exc!r}"
            return Applied(
                rank=self.rank, version=msg.version, ok=False, code=code.value, message=message
            )
        self.held = msg.version
        self.tail_s = time.perf_counter() - t0
        return Applied(
            rank=self.rank,
            version=msg.version,
            ok=True,
            delta_bytes=nbytes,
            seconds=time.perf_counter() - t0,
        )

    def _area_bytes(self, offset: int, length: int) -> bytes:
        if offset + length > self.area.numel():
            raise ApplyError(f"{length} bytes at {offset} overrun the delta area")
        return self.area[offset : offset + length].cpu().numpy().tobytes()

    def _apply(self, msg: ApplyVersion, held: int, early: _Early | None) -> int:
        planned = self._planned = Planned.told(msg, self._planned)
        trailers = [frames.read_trailer(self._area_bytes(o, c)) for o, c in msg.trailers]
        if planned is not None:  # before a byte of them is applied
            planned.check_trailers(trailers)
        self._check_ranges([r for tr in trailers for r in tr.ranges], 0)
        for tr in trailers:
            if tr.version != msg.version:
                raise ApplyError(
                    f"sender rank {tr.sender}'s trailer is of version {tr.version}, "
                    f"not {msg.version}",
                    ErrorCode.TRANSFER,
                )
            if tr.deltas and tr.base != held:
                raise ApplyError(
                    f"sender rank {tr.sender} sent a delta against version {tr.base}; this "
                    f"rank holds {held if held >= 0 else 'no verified version'}",
                    ErrorCode.STALE_BASE,
                )
        applied = early.applied if early is not None else set()
        sums = early.sums if early is not None else {}
        nbytes = early.nbytes if early is not None else 0
        for tr in trailers:
            ranges = set(tr.ranges)
            hashed = self._host({r for r in ranges if (tr.sender, r) not in sums})
            taken: dict[frames.Range, list[int]] = {}
            for offset, length in tr.deltas:
                if (tr.sender, offset) not in applied:
                    found = self._payload(
                        msg.version, tr.base, offset, length, ranges, hashed, hostapply.tail_pool()
                    )
                    for r, value in found.items():
                        taken.setdefault(r, []).append(value)
                    nbytes += length
            for r, values in taken.items():
                if len(values) == 1:  # hashed as its payload wrote it, at the end
                    sums[(tr.sender, r)] = values[0]
                    self.tail_ranges += 1
        for tr in trailers:
            got = digest.combine([self._range_sum(sums, tr.sender, r) for r in tr.ranges])
            if got != tr.digest:
                raise ApplyError(
                    f"checksum mismatch: the bytes from sender rank {tr.sender} "
                    f"({len(tr.ranges)} ranges) are not what it wrote"
                )
        return nbytes

    def _check_ranges(self, ranges: Iterable[frames.Range], spent: int) -> int:
        """`spent` plus the bytes of `ranges`, once each is blocks a plan could write here
        (at least one; several never overlapping; all within its region's registered
        bytes) and the total is at most what this rank holds. A range is walked block by
        block: one that lies (2^40 blocks of a byte at stride 0, the whole region named
        again and again) would hold this rank for hours, where an honest version's ranges
        cover each registered byte at most once."""
        for r in ranges:
            region, offset, length, count, stride = r
            try:
                check_blocks(length, count, stride, stride)
            except ValueError as exc:
                raise ApplyError(f"range {r}: {exc}") from None
            end = self._ends.get(region)
            if end is None or offset + span(length, count, stride) > end:
                raise ApplyError(f"range {r} is not within the registered bytes of region {region}")
            spent += length * count
            if spent > self._holds:
                raise ApplyError(
                    f"range {r} brings the version's ranges to {spent} bytes, more than the "
                    f"{self._holds} bytes this rank holds"
                )
        return spent

    def _range_sum(
        self, sums: dict[tuple[int, frames.Range], int], sender: int, r: frames.Range
    ) -> int:
        """Range `r`'s checksum: taken when its bucket landed, or computed now."""
        got = sums.pop((sender, r), None)
        if got is None:
            self.tail_ranges += 1
            got = digest.range_digest(digest.range_blocks(self.pieces, r), self.is_gpu(r[0]))
        return got

    def _host(self, ranges: set[frames.Range]) -> set[frames.Range]:
        """Those of `ranges` in host memory (checksummed with xxh3)."""
        return {r for r in ranges if not self.is_gpu(r[0])}

    def _payload(
        self,
        version: int,
        base: int,
        offset: int,
        length: int,
        ranges: set[frames.Range],
        hashed: set[frames.Range],
        pool: Executor | None = None,
    ) -> dict[frames.Range, int]:
        """Apply one payload; its blocks must be among `ranges` (what its sender wrote here
        in its bucket, or this version): it never writes where no checksum will look.
        Returns the checksums of those of its blocks in `hashed` it took while writing
        them (`hostapply`: a BLOCK16 body into host memory, on `pool`'s threads when
        given: at a version's end, where nothing is left to overlap it with)."""
        head = frames.read_payload_head(self._area_bytes(offset, min(length, 1 << 20)), length)
        if head.size != length:
            raise ApplyError(f"payload at {offset}: {head.size} bytes, the trailer says {length}")
        stray = next((b for b in head.blocks if b not in ranges), None)
        if stray is not None:
            raise ApplyError(
                f"payload at {offset} writes block {stray}, not a range its sender wrote here"
            )
        if (head.version, head.base) != (version, base):
            raise ApplyError(
                f"payload at {offset} is version {head.version} against {head.base}, "
                f"expected {version} against {base}",
                ErrorCode.TRANSFER,
            )
        w = head.width
        n = codec.elements(frames.blocks_bytes(head.blocks), w)
        if n != head.elements:
            raise ApplyError(
                f"payload at {offset}: {n} elements in its blocks, header {head.elements}"
            )
        if head.kind == codec.Kind.DENSE:
            raise ApplyError(f"payload at {offset} is dense: dense bytes travel as writes")
        body = self.area[offset + head.body_offset : offset + head.size]
        if head.kind == codec.Kind.BLOCK16 and self._host_only(head.blocks):
            return hostapply.block16(
                body.numpy(), n, head.count, w, head.blocks, self.pieces, hashed, pool
            )
        pos, values = codec.decode(codec.Kind(head.kind), body, n, head.count, w)
        start = 0
        for region, dst, blen, count, stride in head.blocks:
            for i in range(count):
                lo = int(torch.searchsorted(pos, start // w))
                hi = int(torch.searchsorted(pos, (start + blen) // w))
                at = start
                for out in self.pieces(region, dst + i * stride, blen) if hi > lo else ():
                    a = int(torch.searchsorted(pos, at // w))
                    b = int(torch.searchsorted(pos, (at + out.numel()) // w))
                    if b > a:
                        local = (pos[a:b] - at // w).to(out.device)
                        codec.scatter(out, local, values[a * w : b * w].to(out.device), w)
                    at += out.numel()
                start += blen
        return {}

    def _host_only(self, blocks: tuple[frames.Range, ...]) -> bool:
        """The compiled host apply takes the payload: a host area, host targets."""
        return (
            decodeloop.compiled()
            and self.area.device.type == "cpu"
            and not any(self.is_gpu(r[0]) for r in blocks)
        )
