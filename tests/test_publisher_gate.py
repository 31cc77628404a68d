"""The publisher's side of a rank's pack counter (`BeginVersion.gate_offset`): buckets
posted before they are packed. Real tcp transports on loopback (the GPU waits themselves:
tests/test_transport_cuda.py and tests/test_pack_gate.py). Checked: a rank's gated
buckets reach the transport in bucket order even when an earlier one is slower to
prepare (a later bucket's copies must never sit in front of an earlier one's on a
lane); a transport the GPU cannot hold back waits for the counter on the daemon's
thread; a failed version releases the counter; and the refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import msgspec
import pytest
import uvloop

from tests.conformance.harness import Pair, with_pair
from tests.conformance.suite import rand
from tests.test_publisher_posts import publisher
from tests.test_publisher_prepared import Wrapping, _ring_plan
from tests.test_transport_tcp import TcpKit
from weightwire.daemon.publisher import Publisher
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import BucketsIssued, BucketsLanded, PublishResult
from weightwire.protocol.plan import RankPlan
from weightwire.transport.base import Gate, LocalRegion, Transport


class _Gate:
    """Records what the publisher asks of a version's pack counter."""

    def __init__(self, log: list[tuple[str, int]], base: int) -> None:
        self.log, self.base = log, base
        self.chain: asyncio.Future[None] | None = None

    def gate(self, bucket: int) -> Gate:
        return Gate(0, 0x1000, self.base + bucket + 1)

    async def wait(self, bucket: int, timeout_s: float) -> None:
        self.log.append(("wait", bucket))

    def release(self) -> None:
        self.log.append(("release", -1))


class _Gating(Wrapping):
    """A tcp transport that takes gated posts (as the cuda transport's `post_gated`),
    recording the order they reach it in, with the gate's value."""

    def __init__(self, inner: Transport, log: list[tuple[str, int]]) -> None:
        super().__init__(inner)
        self.log = log

    async def post_gated(
        self,
        prepared: object,
        imms: Sequence[int | None],
        gate: Gate,
        fencing: tuple[Hashable, Callable[[tuple[bytes, ...]], None]] | None = None,
    ) -> list[BaseException | None]:
        self.log.append(("posted", gate.value))
        return await self.inner.post(prepared, imms)  # type: ignore[arg-type]


PART = 4096
N = 4 * PART  # four buckets of one part each, in a ring of 2 slots


@dataclass
class _Rig:
    """A publisher on node a with a plan of four buckets into node b's region 2 (`dst`),
    its staging (region 1) and the pack counters it makes recording into `log`."""

    pub: Publisher
    staging: LocalRegion
    dst: LocalRegion
    plan: RankPlan
    transport: object
    seen: list[object] = field(default_factory=list)
    log: list[tuple[str, int]] = field(default_factory=list)


def _rig(p: Pair, wrap: Callable[[list[tuple[str, int]]], object] | None = None) -> _Rig:
    """The rig on plain tcp, or on `wrap(log)` (a transport wrapping p.a's)."""
    dst, desc = p.region(p.b, 2, N)
    seen: list[object] = []
    log: list[tuple[str, int]] = []
    transport = p.a.transport if wrap is None else wrap(log)

    async def pick(*_: object) -> object:
        return transport

    pub = publisher(seen, pick)  # type: ignore[arg-type]

    def make(*args: object) -> _Gate:  # (staging, ring, offset, base, buckets, fence)
        offset, base = args[2], args[3]
        assert isinstance(offset, int) and isinstance(base, int)
        log.append(("made", offset))
        return _Gate(log, base)

    pub.make_gate = make
    staging = p.region(p.a, 1, N + 64)[0]
    plan = _ring_plan(desc, PART)
    pub.set_plan(plan)
    pub.staging = staging
    return _Rig(pub, staging, dst, plan, transport, seen, log)


def _run(body: Callable[[TcpKit, Pair], Awaitable[None]]) -> None:
    """`body` on a pair of tcp nodes on loopback, within a minute."""
    kit = TcpKit()
    uvloop.run(asyncio.wait_for(with_pair(kit, lambda p: body(kit, p)), 60))


def test_gated_buckets_reach_the_transport_in_bucket_order() -> None:
    """Four buckets posted at once, bucket 0 slower to prepare than the others: each is
    handed to the transport gated on its own sequence number, in bucket order, and lands
    bitwise; nothing waits on the daemon's thread."""

    async def body(kit: TcpKit, p: Pair) -> None:
        rig = _rig(p, lambda log: _Gating(p.a.transport, log))
        pub, staging, dst, seen, log = rig.pub, rig.staging, rig.dst, rig.seen, rig.log
        parts = pub.prepared.parts

        async def slow_first(run: object, bucket: int, *args: object) -> object:
            if bucket == 0:
                await asyncio.sleep(0.2)
            return await parts(run, bucket, *args)  # type: ignore[arg-type]

        pub.prepared.parts = slow_first  # type: ignore[method-assign]
        data = rand(N, 1)
        kit.fill(staging, 0, data)
        pub.begin(1, "ring", 0, gate_offset=N, fence_base=40)
        for b in range(4):
            pub.bucket_ready(1, (b,))
        await pub.drain(30)
        assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
        assert kit.read(dst, 0, N) == data
        assert log == [("made", N)] + [("posted", 40 + b + 1) for b in range(4)], log
        assert pub.progress()["gated"] is True

    _run(body)


def test_a_transport_the_gpu_cannot_hold_back_waits_on_the_thread() -> None:
    """Plain tcp (no `post_gated`): each bucket waits for the counter on the daemon's
    thread before it is posted; a ring's landings still go out as usual. A version that
    fails releases the counter (so that no copy waits for a rank that is gone)."""

    async def body(kit: TcpKit, p: Pair) -> None:
        rig = _rig(p)
        pub, staging, dst, seen, log = rig.pub, rig.staging, rig.dst, rig.seen, rig.log
        ring = pub.ring(2)
        data = rand(N, 2)
        pub.begin(1, "ring", 2, gate_offset=ring.nbytes + 8)
        for b in range(4):
            if ring.reuse[b] >= 0:
                while not any(
                    isinstance(m, BucketsLanded) and ring.reuse[b] in m.buckets for m in seen
                ):
                    await asyncio.sleep(0.005)
            kit.fill(staging, ring.slot[b] * PART, data[b * PART : (b + 1) * PART])
            pub.bucket_ready(1, (b,))
        await pub.drain(30)
        assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
        assert kit.read(dst, 0, N) == data
        assert [e for e in log if e[0] == "wait"] == [("wait", b) for b in range(4)], log
        assert not any(isinstance(m, BucketsIssued) for m in seen)
        log.clear()
        pub.begin(2, "ring", 2, gate_offset=ring.nbytes + 8)
        pub.bucket_ready(2, (0,))
        pub.abort("the test aborts version 2")
        await pub.drain(30)
        assert isinstance(seen[-1], PublishResult) and not seen[-1].ok
        assert ("release", -1) in log, log

    _run(body)


def test_gate_refused_with_deltas_and_for_buckets_packed_in_place() -> None:
    """A pack counter with a delta-capable plan is refused at BeginVersion (INVALID); a
    bucket said packed in place in a gated version fails the version, naming why."""

    async def body(kit: TcpKit, p: Pair) -> None:
        rig = _rig(p)
        pub, staging, plan, seen = rig.pub, rig.staging, rig.plan, rig.seen
        pub.begin(1, "ring", 0, gate_offset=N)
        pub.bucket_ready(1, (0,), in_place=(0,))
        await pub.drain(30)
        result = seen[-1]
        assert isinstance(result, PublishResult) and not result.ok
        assert "packed in place" in result.message and "before they are packed" in result.message
        pub.set_plan(msgspec.structs.replace(plan, plan_hash="d", delta_bytes=64))
        pub.delta_out = staging  # any region of the bytes it needs
        with pytest.raises(PlanError, match="delta") as err:
            pub.begin(2, "d", 0, gate_offset=N)
        assert err.value.code == ErrorCode.INVALID

    _run(body)


def test_gated_buckets_out_of_order_are_refused() -> None:
    """With a pack counter a later bucket's copies would wait on the GPU in front of an
    earlier one's: a bucket posted after a later one is refused (INVALID), naming both."""
    from weightwire.protocol.errors import VersionError

    async def body(kit: TcpKit, p: Pair) -> None:
        pub = _rig(p, lambda log: _Gating(p.a.transport, log)).pub
        pub.begin(1, "ring", 0, gate_offset=N)
        pub.bucket_ready(1, (1,))
        with pytest.raises(VersionError, match="out of order") as err:
            pub.bucket_ready(1, (0,))
        assert err.value.code == ErrorCode.INVALID
        with pytest.raises(VersionError, match="out of order"):
            pub.bucket_ready(1, (3, 2))
        pub.abort("done")
        await pub.drain(30)

    _run(body)


class _FencedGating(_Gating):
    """A gated transport that also fences slots (as the cuda transport with slot
    counters). Each post's copies wait for `packed[b]` (the GPU's wait on the pack
    counter), and `done[b]` is set once they land; each post's `on_issued` is called at
    once, except bucket 0's, which the test hands over itself (a lane whose budget holds
    that bucket's last copy back)."""

    def __init__(self, inner: Transport, log: list[tuple[str, int]], base: int) -> None:
        super().__init__(inner, log)
        self.base = base
        self.held: list[Callable[[tuple[bytes, ...]], None]] = []
        self.packed = [asyncio.Event() for _ in range(4)]
        self.done = [asyncio.Event() for _ in range(4)]
        self.go = asyncio.Event()  # bucket 0's copies may run (the lane issued its last)

    async def post_fenced(self, *_: object) -> list[BaseException | None]:
        """There (a SlotFencing transport, as the cuda one), never called."""
        raise AssertionError("a gated version posts through post_gated")

    async def post_gated(
        self,
        prepared: object,
        imms: Sequence[int | None],
        gate: Gate,
        fencing: tuple[Hashable, Callable[[tuple[bytes, ...]], None]] | None = None,
    ) -> list[BaseException | None]:
        bucket = gate.value - self.base - 1
        self.log.append(("posted", bucket))
        assert fencing is not None
        if bucket == 0:
            self.held.append(fencing[1])
            await self.go.wait()
        else:
            fencing[1](())
        await self.packed[bucket].wait()
        try:
            return await self.inner.post(prepared, imms)  # type: ignore[arg-type]
        finally:
            self.done[bucket].set()


class _Counters:
    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def signal(self, bucket: int, after: Sequence[int] = ()) -> None:
        self.log.append(("signal", bucket))

    def release(self) -> None:
        self.log.append(("release counters", -1))

    async def settled(self, timeout_s: float) -> bool:
        return True


def test_a_gated_bucket_waits_for_its_slots_fences_to_be_handed_over() -> None:
    """Ring of 2, slot counters, four buckets posted at once: bucket 2 (slot 0 again) is
    handed to the transport only once bucket 0's copies are all issued and its slot
    counter's write queued (`on_issued`), never before: slot events are one per slot and
    lane, and bucket 2's last copy re-recording them first would have bucket 0's counter
    wait for bucket 2's copies, which wait for the packing that waits for that counter.
    Bucket 1 (slot 1) does not wait for it; all lands bitwise."""
    base = 40

    async def body(kit: TcpKit, p: Pair) -> None:
        rig = _rig(p, lambda log: _FencedGating(p.a.transport, log, base))
        pub, staging, dst, seen, log = rig.pub, rig.staging, rig.dst, rig.seen, rig.log
        gating = rig.transport
        assert isinstance(gating, _FencedGating)
        pub.make_counters = lambda *_: _Counters(log)  # type: ignore[assignment,return-value]
        ring = pub.ring(2)
        assert ring.reuse[2] == 0 and ring.slot[2] == ring.slot[0]
        data = rand(N, 3)

        def pack(b: int) -> None:
            kit.fill(staging, ring.slot[b] * PART, data[b * PART : (b + 1) * PART])
            gating.packed[b].set()

        pack(0)
        pack(1)
        pub.begin(1, "ring", 2, fence_offset=ring.nbytes, fence_base=base,
                  gate_offset=ring.nbytes + 8)  # fmt: skip
        for b in range(4):
            pub.bucket_ready(1, (b,))
        await asyncio.wait_for(gating.done[1].wait(), 10)
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert [b for what, b in log if what == "posted"] == [0, 1], log
        assert ("signal", 0) not in log, log  # not landed either
        (handed,) = gating.held
        log.append(("handed", 0))
        handed(())  # bucket 0's last copy issued (the cuda transport: its counter's write)
        gating.go.set()
        await asyncio.wait_for(gating.done[0].wait(), 10)  # bucket 0 read its slot
        pack(2)
        pack(3)
        await pub.drain(30)
        assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
        assert kit.read(dst, 0, N) == data
        assert [b for what, b in log if what == "posted"] == [0, 1, 2, 3], log
        assert log.index(("handed", 0)) < log.index(("posted", 2)), log

    _run(body)
