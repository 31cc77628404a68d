"""A rank's writes are prepared on their transport once per plan and posted every
version. Real tcp transports on loopback: a version after the staging region was
replaced reads the new one, and a new plan writes where it says, bitwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence

import uvloop

from tests.conformance.harness import Pair, with_pair
from tests.conformance.suite import rand
from tests.test_publisher_posts import publisher
from tests.test_transport_tcp import TcpKit
from weightwire.daemon.publisher import Publisher
from weightwire.protocol.local import BucketsIssued, BucketsLanded, PublishResult
from weightwire.protocol.plan import (
    Bucket,
    PackOp,
    RankPlan,
    StagingRing,
    WriteOp,
    decode_imm,
)
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import Box, Copy
from weightwire.transport.base import LocalRegion, Transport

N = 3 * 65536


def _plan(plan_hash: str, dst: RegionDescriptor, shift: int) -> RankPlan:
    """Two buckets of two writes each into `dst`; `shift` moves every destination offset."""
    writes = [
        WriteOp(
            src_offset=i * (N // 4),
            length=N // 4,
            dst_node=dst.node,
            dst_region=2,
            dst_offset=i * (N // 4) + shift,
            slot=7,
        )
        for i in range(4)
    ]
    return RankPlan(
        plan_hash=plan_hash,
        rank=0,
        staging_bytes=N,
        buckets=(
            Bucket(index=0, writes=tuple(writes[:2])),
            Bucket(index=1, writes=tuple(writes[2:])),
        ),
        regions=(dst,),
    )


async def _version(pub: Publisher, results: list[PublishResult], version: int) -> PublishResult:
    assert pub.plan is not None
    pub.begin(version, pub.plan.plan_hash)
    pub.bucket_ready(version, (1,))
    pub.bucket_ready(version, (0,))
    for _ in range(500):
        if results and results[-1].version == version:
            return results[-1]
        await asyncio.sleep(0.01)
    raise AssertionError(f"version {version} never finished")


def test_versions_follow_a_new_staging_region_and_a_new_plan() -> None:
    kit = TcpKit()

    async def body(p: Pair) -> None:
        first, _ = p.region(p.a, 1, N)
        second, _ = p.region(p.a, 3, N)
        dst, desc = p.region(p.b, 2, N + 4096)
        results: list[PublishResult] = []

        async def pick(*_: object) -> Transport:
            return p.a.transport

        pub = publisher(results, pick)
        pub.set_plan(_plan("one", desc, 0))
        for version, staging, seed in ((1, first, 1), (2, first, 2), (3, second, 3)):
            data = rand(N, seed)
            kit.fill(staging, 0, data)
            pub.staging = staging
            result = await _version(pub, results, version)
            assert result.ok and result.nbytes == N, result
            assert kit.read(dst, 0, N) == data, f"version {version}"
        pub.set_plan(_plan("two", desc, 4096))
        kit.fill(second, 0, rand(N, 4))
        assert (await _version(pub, results, 4)).ok
        assert kit.read(dst, 4096, N) == rand(N, 4)
        counts: dict[int, int] = {}
        for imm, _ in p.b.imms:
            low, slot = decode_imm(imm)
            assert slot == 7
            counts[low] = counts.get(low, 0) + 1
        assert counts == {1: 4, 2: 4, 3: 4, 4: 4}

    uvloop.run(asyncio.wait_for(with_pair(kit, body), 60))


def test_a_failed_bucket_is_reported_after_the_rest_of_its_post_landed() -> None:
    """Buckets 0 and 1 posted in one message; bucket 0's write is refused at once, bucket
    1 moves 64 MiB. The rank learns of the failure only once bucket 1's writes are done:
    it may reuse staging as soon as it is told, so nothing may still be reading it."""
    kit = TcpKit()
    big = 64 << 20

    async def body(p: Pair) -> None:
        staging, _ = p.region(p.a, 1, big)
        dst, desc = p.region(p.b, 2, big)
        data = rand(big, 9)
        kit.fill(staging, 0, data)
        seen: list[tuple[PublishResult, bool]] = []

        def reply(result: PublishResult) -> None:  # what the rank would see, when it sees it
            seen.append((result, kit.read(dst, 0, big) == data))

        async def pick(*_: object) -> Transport:
            return p.a.transport

        pub = publisher([], pick)
        pub.reply = reply
        quarter = big // 4
        good = tuple(
            WriteOp(
                src_offset=i * quarter,
                length=quarter,
                dst_node="node-b",
                dst_region=2,
                dst_offset=i * quarter,
                slot=7,
            )
            for i in range(4)
        )
        refused = WriteOp(
            src_offset=0, length=16, dst_node="node-b", dst_region=2, dst_offset=big, slot=7
        )
        pub.set_plan(
            RankPlan(
                plan_hash="h",
                rank=0,
                staging_bytes=big,
                buckets=(Bucket(index=0, writes=(refused,)), Bucket(index=1, writes=good)),
                regions=(desc,),
            )
        )
        pub.staging = staging
        pub.begin(1, "h")
        pub.bucket_ready(1, (0, 1))
        await pub.drain(30)
        ((result, landed),) = seen
        assert not result.ok and "outside region 2" in result.message
        assert landed, "the failure was reported while bucket 1 was still being written"

    uvloop.run(asyncio.wait_for(with_pair(kit, body), 60))


def _ring_plan(dst: RegionDescriptor, part: int) -> RankPlan:
    """Four buckets, each one pack and one write of `part` bytes into region 2 of `dst`."""
    return RankPlan(
        plan_hash="ring",
        rank=0,
        staging_bytes=4 * part,
        buckets=tuple(
            Bucket(
                index=b,
                packs=(
                    PackOp(
                        source="w",
                        box=Box.full((part,)),
                        transform=Copy(),
                        staging_offset=b * part,
                        nbytes=part,
                    ),
                ),
                writes=(
                    WriteOp(
                        src_offset=b * part,
                        length=part,
                        dst_node=dst.node,
                        dst_region=2,
                        dst_offset=b * part,
                        slot=7,
                    ),
                ),
            )
            for b in range(4)
        ),
        regions=(dst,),
    )


async def _fill_ring(
    kit: TcpKit,
    pub: Publisher,
    ring: StagingRing,
    staging: LocalRegion,
    data: bytes,
    part: int,
    version: int,
    seen: Sequence[object],
) -> None:
    """Packs (fills) each of the four buckets into its slot and says it ready, once the
    bucket before it in that slot has landed (tcp reads staging until then)."""
    for b in range(4):
        if ring.reuse[b] >= 0:
            while not any(
                isinstance(m, BucketsLanded) and m.version == version and ring.reuse[b] in m.buckets
                for m in seen
            ):
                await asyncio.sleep(0.005)
        kit.fill(staging, ring.slot[b] * part, data[b * part : (b + 1) * part])
        pub.bucket_ready(version, (b,))


def test_a_staging_ring_writes_each_bucket_from_its_slot_prepared_once() -> None:
    """Four buckets through a ring of two slots: each bucket's writes read from its slot
    (its planned offsets shifted), are prepared once per (bucket, slot) and reused the next
    version, and each bucket's end is reported (`BucketsLanded`) so that the rank can pack
    the next bucket into that slot; without a ring, no such reports."""
    kit = TcpKit()
    part = 4096  # each bucket: one pack and one write of `part` bytes
    n = 4 * part

    async def body(p: Pair) -> None:
        dst, desc = p.region(p.b, 2, n)
        seen: list[PublishResult | BucketsLanded] = []

        async def pick(*_: object) -> Transport:
            return p.a.transport

        pub = publisher(seen, pick)  # type: ignore[arg-type]
        pub.set_plan(_ring_plan(desc, part))
        ring = pub.ring(2)
        assert ring.slots == 2 and ring.nbytes == 2 * part
        staging, _ = p.region(p.a, 1, ring.nbytes)
        pub.staging = staging
        prepared = {}
        for version in (1, 2):
            data = rand(n, version)
            pub.begin(version, "ring", 2)
            await _fill_ring(kit, pub, ring, staging, data, part, version, seen)
            await pub.drain(30)
            assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
            landed = [m for m in seen if isinstance(m, BucketsLanded) and m.version == version]
            assert sorted(b for m in landed for b in m.buckets) == [0, 1, 2, 3]
            assert kit.read(dst, 0, n) == data, f"version {version}"
            assert set(pub.prepared.cache) == {(0, 0, ""), (1, 1, ""), (2, 0, ""), (3, 1, "")}
            parts = {k: c.parts for k, c in pub.prepared.cache.items()}
            if prepared:  # the same prepared writes, posted again
                assert all(parts[k] is prepared[k] for k in parts)
            prepared = parts
        seen.clear()
        big, _ = p.region(p.a, 3, n)  # the whole send: planned offsets, no reports
        data = rand(n, 3)
        kit.fill(big, 0, data)
        pub.staging = big
        pub.begin(3, "ring")
        pub.bucket_ready(3, (0, 1, 2, 3))
        await pub.drain(30)
        assert [type(m) for m in seen] == [PublishResult] and seen[0].ok
        assert kit.read(dst, 0, n) == data

    uvloop.run(asyncio.wait_for(with_pair(kit, body), 60))


class Wrapping:
    """A transport around a real one (`inner`), doing whatever it does not define itself
    as `inner` does: the tests' stand-ins for what only the cuda transport does."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _Issuing(Wrapping):
    """A tcp transport that also reports its posts issued, as the cuda transport does once
    its copies are queued, with one 64-byte "event handle" per (slot key): the publisher's
    side of `BucketsIssued` on real writes."""

    async def post_fenced(
        self,
        prepared: object,
        imms: Sequence[int | None],
        slot: Hashable,
        on_issued: Callable[[tuple[bytes, ...]], None],
    ) -> list[BaseException | None]:
        writing = asyncio.ensure_future(self.inner.post(prepared, imms))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # queued
        on_issued((repr(slot).encode().ljust(64, b"\0"),))
        return await writing


def test_buckets_whose_writes_all_fence_are_reported_issued_with_their_slots_events() -> None:
    """A ring of 2 slots, four buckets: with the rank asking for slot events and every
    write on a transport that fences, each bucket is reported issued (its slot's event)
    before it is reported landed, bitwise; without the rank asking, or with a transport
    that does not fence, only landings."""
    kit = TcpKit()
    part = 4096
    n = 4 * part

    async def body(p: Pair) -> None:
        dst, desc = p.region(p.b, 2, n)
        seen: list[PublishResult | BucketsLanded | BucketsIssued] = []
        fencing = _Issuing(p.a.transport)
        use: list[object] = [fencing]

        async def pick(*_: object) -> object:
            return use[0]

        pub = publisher(seen, pick)  # type: ignore[arg-type]
        pub.set_plan(_ring_plan(desc, part))
        ring = pub.ring(2)
        staging, _ = p.region(p.a, 1, ring.nbytes)
        pub.staging = staging
        cases = ((1, True, fencing), (2, False, fencing), (3, True, p.a.transport))
        for version, ask, transport in cases:
            use[0] = transport
            pub.prepared.cache.clear()  # routes through the transport of this case
            data = rand(n, version)
            pub.begin(version, "ring", 2, slot_events=ask)
            await _fill_ring(kit, pub, ring, staging, data, part, version, seen)
            await pub.drain(30)
            mine = [m for m in seen if not isinstance(m, PublishResult) and m.version == version]
            assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
            assert kit.read(dst, 0, n) == data, f"version {version}"
            issued = [m for m in mine if isinstance(m, BucketsIssued)]
            if ask and transport is fencing:
                assert [m.buckets for m in issued] == [(0,), (1,), (2,), (3,)]
                for m in issued:  # the slot's own event, the same for every bucket in it
                    key = repr(("j", 0, ring.slot[m.buckets[0]])).encode().ljust(64, b"\0")
                    assert m.events == (key,), m
                for b in range(4):  # reported issued before landed
                    order = [type(m) for m in mine if b in m.buckets]
                    assert order == [BucketsIssued, BucketsLanded], (b, order)
                assert pub.progress()["buckets_issued"] == 4
            else:
                assert not issued and pub.progress()["buckets_issued"] == 0
                assert sorted(b for m in mine for b in m.buckets) == [0, 1, 2, 3]

    uvloop.run(asyncio.wait_for(with_pair(kit, body), 60))


class _IssuingEvents(_Issuing):
    """As `_Issuing`, with events this process can wait on (the cuda transport's
    `events_of`): a slot counter is written on the GPU after them."""

    def events_of(self, handles: Sequence[bytes]) -> list[int] | None:
        return [len(h) for h in handles]


class _Counters:
    """Records what the publisher asks of a version's GPU slot counters (the driver's
    writes themselves are tested on a GPU, tests/test_slot_counters.py)."""

    def __init__(self, log: list[tuple[str, int, tuple[int, ...]]]) -> None:
        self.log = log

    def signal(self, bucket: int, after: Sequence[int] = ()) -> None:
        self.log.append(("signal", bucket, tuple(after)))

    def release(self) -> None:
        self.log.append(("release", -1, ()))


def test_slot_counters_are_signalled_once_per_bucket_on_the_gpu_or_at_landing() -> None:
    """A ring of 2 slots, four buckets, the rank waiting on GPU slot counters: with every
    write on a transport whose events this process can wait on, each bucket's counter is
    written right after its copies are issued (behind their events); on plain tcp, once it
    landed. Each bucket once, no BucketsIssued or BucketsLanded sent, bitwise. A version
    aborted midway releases the counters, and signals nothing after."""
    kit = TcpKit()
    part = 4096
    n = 4 * part

    async def body(p: Pair) -> None:
        dst, desc = p.region(p.b, 2, n)
        seen: list[PublishResult | BucketsLanded | BucketsIssued] = []
        log: list[tuple[str, int, tuple[int, ...]]] = []
        fencing = _IssuingEvents(p.a.transport)
        use: list[object] = [fencing]

        async def pick(*_: object) -> object:
            return use[0]

        pub = publisher(seen, pick)  # type: ignore[arg-type]
        made: list[tuple[int, int, int]] = []

        def make(staging: object, ring: StagingRing, offset: int, base: int, buckets: int):  # type: ignore[no-untyped-def]
            made.append((offset, base, buckets))
            return _Counters(log)

        pub.make_counters = make
        pub.set_plan(_ring_plan(desc, part))
        ring = pub.ring(2)
        staging, _ = p.region(p.a, 1, ring.nbytes + 64)
        pub.staging = staging

        async def signalled(bucket: int) -> None:
            while not any(e[0] == "signal" and e[1] == bucket for e in log):
                await asyncio.sleep(0.005)

        for version, transport in ((1, fencing), (2, p.a.transport)):
            use[0] = transport
            pub.prepared.cache.clear()
            log.clear()
            data = rand(n, version)
            pub.begin(version, "ring", 2, fence_offset=ring.nbytes, fence_base=10 * version)
            assert made[-1] == (ring.nbytes, 10 * version, 4)
            for b in range(4):
                if ring.reuse[b] >= 0:
                    await signalled(ring.reuse[b])
                kit.fill(staging, ring.slot[b] * part, data[b * part : (b + 1) * part])
                pub.bucket_ready(version, (b,))
            await pub.drain(30)
            assert isinstance(seen[-1], PublishResult) and seen[-1].ok, seen[-1]
            assert kit.read(dst, 0, n) == data, f"version {version}"
            assert not [m for m in seen if isinstance(m, (BucketsLanded, BucketsIssued))]
            assert sorted(b for kind, b, _ in log if kind == "signal") == [0, 1, 2, 3], log
            after = {b: a for _, b, a in log}
            if transport is fencing:  # on the GPU, behind the copies' events
                assert all(after[b] == (64,) for b in range(4)), log
                assert pub.progress()["buckets_issued"] == 4
            else:  # at landing
                assert all(after[b] == () for b in range(4)), log
            assert pub.progress()["slot_counters"] is True
        log.clear()
        pub.begin(3, "ring", 2, fence_offset=ring.nbytes, fence_base=30)
        pub.bucket_ready(3, (0,))
        await signalled(0)
        pub.abort("the test aborts version 3")
        pub.bucket_ready(3, (1,))  # after the failure: nothing more is sent or signalled
        await pub.drain(30)
        assert isinstance(seen[-1], PublishResult) and not seen[-1].ok
        assert log == [("signal", 0, ()), ("release", -1, ())], log

    uvloop.run(asyncio.wait_for(with_pair(kit, body), 60))
