"""The conformance suite on the cuda transport (GPU memory, one host). Needs a GPU: run by
scripts/gpu-suite.sh on a GPU machine; skipped elsewhere, saying why."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from tests.conformance.harness import Pair, TransportKit
from tests.conformance.suite import *  # noqa: F403
from weightwire.memory.cudadrv import available, driver
from weightwire.protocol.errors import PeerLostError
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import Gate, LocalRegion, Transport, WriteRequest

OK, WHY = available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]


class CudaKit(TransportKit):
    """Regions are device allocations; with two GPUs the nodes use different ones."""

    name = "cuda"

    def __init__(self) -> None:
        self.drv = driver()
        self.devices = len(self.drv.devices)
        self._count = 0

    def make(self, node: str) -> Transport:
        from weightwire.transport.cuda import CudaTransport

        return CudaTransport(node)

    def region(self, region_id: int, length: int) -> LocalRegion:
        device = self._count % self.devices
        self._count += 1
        self.drv.use(device)
        ptr = self.drv.alloc(length)
        base, _ = self.drv.address_range(ptr)
        return LocalRegion(
            id=region_id,
            kind="gpu",
            length=length,
            address=ptr,
            device=device,
            extra={
                "ipc_handle": self.drv.ipc_handle(base),
                "ipc_offset": ptr - base,
                "device_uuid": self.drv.devices[device].uuid,
            },
        )

    def read(self, region: LocalRegion, offset: int, length: int) -> bytes:
        assert region.device is not None
        self.drv.use(region.device)
        host = ctypes.create_string_buffer(length)
        s = self.drv.stream()
        self.drv.copy_async(ctypes.addressof(host), region.address + offset, length, s)
        self.drv.synchronize(s)
        return host.raw

    def fill(self, region: LocalRegion, offset: int, data: bytes) -> None:
        assert region.device is not None
        self.drv.use(region.device)
        host = ctypes.create_string_buffer(data, len(data))
        s = self.drv.stream()
        self.drv.copy_async(region.address + offset, ctypes.addressof(host), len(data), s)
        self.drv.synchronize(s)

    def release(self, region: LocalRegion) -> None:
        assert region.device is not None
        self.drv.use(region.device)
        self.drv.free(region.address)


@pytest.fixture
def kit() -> TransportKit:
    return CudaKit()


CHUNK, COUNT = 256 * 1024, 64


def _small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.transport.cuda import lanes

    monkeypatch.setattr(lanes, "MAX_OPS_IN_FLIGHT", 4)  # a write and its event: 2 ops


def _lanes(t: Transport) -> list:  # type: ignore[type-arg]
    return list(t._lanes.values())  # type: ignore[attr-defined]


def _filled(p: Pair) -> tuple[LocalRegion, LocalRegion, RegionDescriptor, bytes]:
    src, _ = p.region(p.a, 1, CHUNK * COUNT)
    dst, desc = p.region(p.b, 2, CHUNK * COUNT)
    data = rand(CHUNK * COUNT, 3)  # noqa: F405
    p.kit.fill(src, 0, data)
    return src, dst, desc, data


def _start_writes(p: Pair, src: LocalRegion, desc: RegionDescriptor) -> list[asyncio.Future[None]]:
    """COUNT concurrent writes of CHUNK bytes, write i with immediate i."""
    return [
        asyncio.ensure_future(
            p.a.transport.write(WriteRequest(src, i * CHUNK, desc, i * CHUNK, CHUNK, i))
        )
        for i in range(COUNT)
    ]


def test_lane_budget_bounds_copies_in_flight(
    kit: TransportKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 4 driver operations allowed in flight, 64 concurrent writes take turns and all
    land, bitwise, each immediate once; a batch needing more than the budget is issued on
    a thread."""
    _small_budget(monkeypatch)

    async def body(p: Pair) -> None:
        src, dst, desc, data = _filled(p)
        await asyncio.gather(
            *(
                p.a.transport.write(WriteRequest(src, i * CHUNK, desc, i * CHUNK, CHUNK, i))
                for i in range(COUNT)
            )
        )
        assert p.kit.read(dst, 0, CHUNK * COUNT) == data
        assert sorted(imm for imm, _ in p.b.imms) == list(range(COUNT))
        (lane,) = _lanes(p.a.transport)
        assert lane.budget.peak == 4 and lane.budget.used == 0
        assert lane.issued["thread"] == 0
        p.kit.fill(dst, 0, bytes(CHUNK * 8))
        reqs = [WriteRequest(src, i * CHUNK, desc, i * CHUNK, CHUNK, None) for i in range(8)]
        posted = p.a.transport.post(p.a.transport.prepare(reqs), [None] * 8)
        assert await posted == [None] * 8
        assert p.kit.read(dst, 0, CHUNK * 8) == data[: CHUNK * 8]
        assert lane.issued["thread"] == 1 and lane.budget.used == 0

    run(kit, body)  # noqa: F405


def test_cancelled_writes_leave_the_lane_whole(
    kit: TransportKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers cancelled while waiting for room or while their copies run: the budget comes
    back whole, the writes not cancelled land bitwise, and the lane goes on working."""
    _small_budget(monkeypatch)

    async def body(p: Pair) -> None:
        src, dst, desc, data = _filled(p)
        tasks = _start_writes(p, src, desc)
        await asyncio.sleep(0)
        for t in tasks[1::2]:
            t.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        kept = [i for i, o in enumerate(outcomes) if o is None]
        assert set(range(0, COUNT, 2)) <= set(kept)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes if o is not None)
        for i in kept:
            assert p.kit.read(dst, i * CHUNK, CHUNK) == data[i * CHUNK : (i + 1) * CHUNK]
        (lane,) = _lanes(p.a.transport)
        for _ in range(200):  # cancelled writes already issued still finish on their own
            if lane.budget.used == 0:
                break
            await asyncio.sleep(0.05)
        assert lane.budget.used == 0
        assert set(range(0, COUNT, 2)) <= {imm for imm, _ in p.b.imms}
        await p.a.transport.write(WriteRequest(src, CHUNK, desc, CHUNK, CHUNK, 999))
        assert p.kit.read(dst, CHUNK, CHUNK) == data[CHUNK : 2 * CHUNK]

    run(kit, body)  # noqa: F405


def test_close_resolves_every_write_in_flight_or_waiting(
    kit: TransportKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing with writes waiting for room: each one either lands (bitwise) or fails with
    a typed error; none hangs, and a write after close is refused."""
    _small_budget(monkeypatch)

    async def body(p: Pair) -> None:
        src, dst, desc, data = _filled(p)
        tasks = _start_writes(p, src, desc)
        await tasks[0]  # some land before the close, the rest still wait for room
        await asyncio.wait_for(p.a.transport.close(), 30)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        landed = [i for i, o in enumerate(outcomes) if o is None]
        refused = [o for o in outcomes if o is not None]
        assert landed and refused, outcomes
        assert all(isinstance(o, PeerLostError) for o in refused), refused
        for i in landed:
            assert p.kit.read(dst, i * CHUNK, CHUNK) == data[i * CHUNK : (i + 1) * CHUNK]
        assert sorted(imm for imm, _ in p.b.imms) == landed
        with pytest.raises(PeerLostError):
            await p.a.transport.write(WriteRequest(src, 0, desc, 0, CHUNK, None))

    run(kit, body)  # noqa: F405


@pytest.mark.parametrize("pinned", [True, False])
def test_host_source_pinned_or_pageable_lands(kit: TransportKit, pinned: bool) -> None:
    """A CPU-replica write: host memory to a GPU region. Registered (pinned) memory is
    issued on the loop; pageable memory on a thread, since the driver may wait for such a
    copy. Both land bitwise, with their immediates."""

    async def body(p: Pair) -> None:
        n = 3 * MiB + 17  # noqa: F405
        data = rand(n, 11)  # noqa: F405
        host = ctypes.create_string_buffer(data, n)
        src = LocalRegion(
            id=90, kind="cpu", length=n, view=memoryview(host), address=ctypes.addressof(host)
        )
        if pinned:
            p.a.transport.register(src)
            assert p.a.transport._regions.pinned == {90: src.address}  # type: ignore[attr-defined]
        try:
            dst, desc = p.region(p.b, 91, n)
            await p.a.transport.write(WriteRequest(src, 0, desc, 0, n, 5))
            assert p.kit.read(dst, 0, n) == data
            assert p.b.imms == [(5, "node-a")]
            (lane,) = _lanes(p.a.transport)
            assert lane.issued == ({"loop": 1, "thread": 0} if pinned else {"loop": 0, "thread": 1})
        finally:
            if pinned:
                p.a.transport.deregister(src.id)

    run(kit, body)  # noqa: F405


def test_prepared_writes_follow_a_destination_registered_again(kit: TransportKit) -> None:
    """The destination is deregistered and registered again under its id, at new memory:
    the prepared writes resolve it again and land there, bitwise; the memory they were
    prepared for is not written."""

    async def body(p: Pair) -> None:
        n = 4 * MiB + 5  # noqa: F405
        src, _ = p.region(p.a, 1, n)
        old, desc = p.region(p.b, 2, n)
        p.kit.fill(src, 0, rand(n, 41))  # noqa: F405
        prepared = p.a.transport.prepare([WriteRequest(src, 0, desc, 0, n, None)])
        assert await p.a.transport.post(prepared, [1]) == [None]
        assert p.kit.read(old, 0, n) == rand(n, 41)  # noqa: F405
        epoch = prepared.epoch  # type: ignore[attr-defined]
        await p.a.transport.connect("node-b", p.b.transport.endpoints())  # as every pick does
        assert await p.a.transport.post(prepared, [1]) == [None]
        assert prepared.epoch == epoch  # type: ignore[attr-defined]  # not resolved again
        p.b.transport.deregister(2)
        new, _ = p.region(p.b, 2, n)
        p.kit.fill(old, 0, bytes(n))
        p.kit.fill(new, 0, bytes(n))
        p.kit.fill(src, 0, rand(n, 42))  # noqa: F405
        assert await p.a.transport.post(prepared, [2]) == [None]
        assert p.kit.read(new, 0, n) == rand(n, 42)  # noqa: F405
        assert p.kit.read(old, 0, n) == bytes(n)
        assert p.b.imms == [(1, "node-a"), (1, "node-a"), (2, "node-a")]

    run(kit, body)  # noqa: F405


@pytest.mark.parametrize(("start", "want"), [(5, 7), (0xFFFFFFFE, 1)])  # and across the wrap
def test_gated_post_waits_on_the_gpu_for_the_pack_counter(
    kit: TransportKit, start: int, want: int
) -> None:
    """A post gated on a 32-bit word (`post_gated`, a rank's pack counter): its lane's
    stream waits on the GPU until the word reaches the gate's value (cyclically), so
    nothing is copied before; once the word is written, it lands bitwise, with its
    immediate, and the lane goes on working."""

    async def body(p: Pair) -> None:
        src, dst, desc, data = _filled(p)
        assert src.device is not None
        drv = p.kit.drv  # type: ignore[attr-defined]
        drv.use(src.device)
        word, s = drv.alloc(4), drv.stream()
        try:
            drv.write_value32(s, word, start)
            drv.synchronize(s)
            p.kit.fill(dst, 0, bytes(CHUNK))
            t = p.a.transport
            prepared = t.prepare([WriteRequest(src, 0, desc, 0, CHUNK, None)])
            posted = asyncio.ensure_future(
                t.post_gated(prepared, [7], Gate(src.device, word, want))  # type: ignore[attr-defined]
            )
            await asyncio.sleep(0.3)
            assert not posted.done(), "the copy did not wait for the counter"
            assert p.kit.read(dst, 0, CHUNK) == bytes(CHUNK)
            drv.use(src.device)
            drv.write_value32(s, word, want)
            drv.synchronize(s)
            assert await asyncio.wait_for(posted, 30) == [None]
            assert p.kit.read(dst, 0, CHUNK) == data[:CHUNK]
            assert p.b.imms == [(7, "node-a")]
            await t.write(WriteRequest(src, CHUNK, desc, CHUNK, CHUNK, 8))
            assert p.kit.read(dst, CHUNK, CHUNK) == data[CHUNK : 2 * CHUNK]
        finally:
            drv.use(src.device)
            drv.free(word)

    run(kit, body)  # noqa: F405


def test_a_region_deregistered_under_a_large_write_is_drained_and_the_write_fails(
    kit: TransportKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 MiB write issued and held on the GPU (gated), smaller writes into the same
    region behind it on the lane (a budget of 4 operations: one issued, the rest queued),
    and the region is deregistered (its rank left). The region is not drained while the
    large copy waits (at once, nor after 0.2 s: a bounded no); once the gate opens it is.
    Every write fails peer_lost, none with an immediate: the issued ones went into memory
    now gone, the queued ones are never issued (their bytes stay zero). The lane's budget
    is all back and the transport keeps serving: a write into another region lands."""
    _small_budget(monkeypatch)
    n, small = 64 * MiB, 8  # noqa: F405

    async def body(p: Pair) -> None:
        size = n + small * CHUNK
        src, _ = p.region(p.a, 1, size)
        dst, desc = p.region(p.b, 2, size)
        data = rand(size, 17)  # noqa: F405
        p.kit.fill(src, 0, data)
        p.kit.fill(dst, 0, bytes(size))
        assert src.device is not None
        drv = p.kit.drv  # type: ignore[attr-defined]
        drv.use(src.device)
        word, s = drv.alloc(4), drv.stream()
        try:
            drv.write_value32(s, word, 0)
            drv.synchronize(s)
            t = p.a.transport
            big = asyncio.ensure_future(
                t.post_gated(  # type: ignore[attr-defined]
                    t.prepare([WriteRequest(src, 0, desc, 0, n, None)]),
                    [1],
                    Gate(src.device, word, 1),
                )
            )
            rest = [
                asyncio.ensure_future(
                    t.write(WriteRequest(src, n + i * CHUNK, desc, n + i * CHUNK, CHUNK, 10 + i))
                )
                for i in range(small)
            ]
            await asyncio.sleep(0.2)
            assert not big.done() and not any(r.done() for r in rest), "the gate did not hold"
            p.b.transport.deregister(2)
            assert not p.b.transport.drained(2, 0.0)
            assert not await asyncio.to_thread(p.b.transport.drained, 2, 0.2)
            drv.use(src.device)
            drv.write_value32(s, word, 1)  # the copies run now
            drv.synchronize(s)
            assert await asyncio.to_thread(p.b.transport.drained, 2, 30)
            [outcome] = await asyncio.wait_for(big, 30)
            assert isinstance(outcome, PeerLostError) and "region 2 is gone" in outcome.message
            outcomes = await asyncio.wait_for(asyncio.gather(*rest, return_exceptions=True), 30)
            assert all(isinstance(o, PeerLostError) for o in outcomes), outcomes
            assert p.b.imms == []
            for i in range(2, small):  # queued when it went: never issued
                assert p.kit.read(dst, n + i * CHUNK, CHUNK) == bytes(CHUNK), i
            (lane,) = _lanes(t)
            assert lane.budget.used == 0
            other, other_desc = p.region(p.b, 3, CHUNK)
            await t.write(WriteRequest(src, 0, other_desc, 0, CHUNK, 5))
            assert p.kit.read(other, 0, CHUNK) == data[:CHUNK]
            assert p.b.imms == [(5, "node-a")]
        finally:
            drv.use(src.device)
            drv.free(word)

    run(kit, body)  # noqa: F405


def test_a_drained_region_leaves_no_peer_mapping_of_its_allocation(kit: TransportKit) -> None:
    """Two GPUs: a write from one into a region of the same node on the other goes through
    a peer mapping of the region's allocation (its IPC handle opened in the copying GPU's
    context). Once the region is deregistered and drained, that mapping is closed (one left
    open keeps the rank's memory allocated, and its release undefined); a region
    registered after lands bitwise."""
    if kit.devices < 2:  # type: ignore[attr-defined]
        pytest.skip("needs two GPUs")

    async def body(p: Pair) -> None:
        t = p.a.transport
        src, _ = p.region(p.a, 1, MiB)  # noqa: F405
        dst, desc = p.region(p.a, 2, MiB)  # noqa: F405
        assert src.device != dst.device
        p.kit.fill(src, 0, rand(MiB, 23))  # noqa: F405
        await t.write(WriteRequest(src, 0, desc, 0, MiB, 1))  # noqa: F405
        assert p.kit.read(dst, 0, MiB) == rand(MiB, 23)  # noqa: F405
        handle = dst.extra["ipc_handle"]
        mapped = t._ipc._mapped  # type: ignore[attr-defined]
        if not any(k[0] == handle and base for k, base in mapped.items()):
            pytest.skip("no peer mapping made here (WEIGHTWIRE_CUDA_P2P, or no P2P)")
        t.deregister(2)
        assert await asyncio.to_thread(t.drained, 2, 10)
        assert not any(k[0] == handle for k in t._ipc._mapped)  # type: ignore[attr-defined]
        other, other_desc = p.region(p.a, 3, MiB)  # noqa: F405
        await t.write(WriteRequest(src, 0, other_desc, 0, MiB, 2))  # noqa: F405
        assert p.kit.read(other, 0, MiB) == rand(MiB, 23)  # noqa: F405

    run(kit, body)  # noqa: F405
