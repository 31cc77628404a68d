"""tcp with GPU regions: each stream moves them through at most `bounce_bytes` of pinned
memory, writes larger than that in pieces. The conformance suite with GPU regions at
both ends and a 1 MiB bounce (most of its writes go in pieces), in each security mode;
writes nine times the bounce, GPU to GPU, host to GPU and GPU to host, bitwise, each
immediate delivered only once all its bytes are on the GPU, no stream ever holding more
than the bounce, and every buffer given back when the streams end. Needs a GPU: run by
scripts/gpu-suite.sh on a GPU machine; skipped elsewhere, saying why. The piece protocol
without a GPU: tests/test_tcp_pieces.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.conformance.harness import Node, Pair
from tests.conformance.suite import *  # noqa: F403
from tests.conformance.suite import rand, run
from tests.test_transport_cuda import CudaKit
from tests.test_transport_tcp import TcpKit
from weightwire.memory.cudadrv import available
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.tcp.bounce import Bounce, Pinned

OK, WHY = available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]

MiB = 1 << 20
STREAMS = 3  # TcpKit's streams per peer


class TcpGpuKit(TcpKit):
    """tcp transports (TcpKit's) whose regions are device allocations (CudaKit's); host
    regions too, by `host_region`."""

    name = "tcp-gpu"

    def __init__(self, security: str = "auth", bounce_bytes: int = MiB) -> None:
        super().__init__(security, bounce_bytes)
        self.gpu = CudaKit()

    def region(self, region_id: int, length: int) -> LocalRegion:
        return self.gpu.region(region_id, length)

    def host_region(self, region_id: int, length: int) -> LocalRegion:
        return super().region(region_id, length)

    def read(self, region: LocalRegion, offset: int, length: int) -> bytes:
        if region.kind == "gpu":
            return self.gpu.read(region, offset, length)
        return super().read(region, offset, length)

    def fill(self, region: LocalRegion, offset: int, data: bytes) -> None:
        if region.kind == "gpu":
            self.gpu.fill(region, offset, data)
        else:
            super().fill(region, offset, data)

    def release(self, region: LocalRegion) -> None:
        if region.kind == "gpu":
            self.gpu.release(region)


@pytest.fixture(params=["auth", "encrypt", "off"])
def kit(request: pytest.FixtureRequest) -> TcpGpuKit:
    return TcpGpuKit(request.param)


def place(p: Pair, node: Node, region_id: int, length: int, kind: str) -> tuple[
    LocalRegion, RegionDescriptor
]:  # fmt: skip
    kit = p.kit
    assert isinstance(kit, TcpGpuKit)
    region = kit.region(region_id, length) if kind == "gpu" else kit.host_region(region_id, length)
    p.regions.append(region)
    keys = node.transport.register(region)
    node.transport.authorize(region_id, frozenset({p.a.name, p.b.name}))
    return region, RegionDescriptor(
        id=region_id, node=node.name, kind=region.kind, length=length, keys=keys
    )


@pytest.mark.parametrize("cap", [MiB, 4 * MiB])
@pytest.mark.parametrize("route", ["gpu-gpu", "cpu-gpu", "gpu-cpu"])
@pytest.mark.parametrize("security", ["auth", "encrypt", "off"])
def test_writes_nine_times_the_bounce_land_bitwise_through_at_most_it(
    security: str, route: str, cap: int
) -> None:
    """Three concurrent writes of 9 bounces and some (odd offsets) and one strided write
    across the bounce's edges: bitwise, every immediate once and only after its bytes are
    all in the destination, no stream's pinned buffer over the bounce; after close, none."""
    kit = TcpGpuKit(security, cap)
    src_kind, dst_kind = route.split("-")
    n, count = 9 * cap + 12345, 3
    size = count * n + 64

    async def body(p: Pair) -> None:
        src, _ = place(p, p.a, 1, size, src_kind)
        dst, desc = place(p, p.b, 2, size, dst_kind)
        data = rand(size, 11)
        kit.fill(src, 0, data)
        kit.fill(dst, 0, bytes(size))
        bad: list[int] = []

        def check(imm: int, source: str) -> None:  # on the loop, as the immediate arrives
            i = imm - 700
            if i < count and kit.read(dst, 5 + i * n, n) != data[3 + i * n : 3 + (i + 1) * n]:
                bad.append(i)

        p.b.on_imm_check = check
        await asyncio.gather(
            *(
                p.a.transport.write(WriteRequest(src, 3 + i * n, desc, 5 + i * n, n, 700 + i))
                for i in range(count)
            )
        )
        assert not bad, f"immediates delivered before their bytes were all there: {bad}"
        for i in range(count):
            got = kit.read(dst, 5 + i * n, n)
            assert got == data[3 + i * n : 3 + (i + 1) * n], f"write {i} differs"
        assert kit.read(dst, 0, 5) == bytes(5)
        assert kit.read(dst, 5 + count * n, size - 5 - count * n) == bytes(size - 5 - count * n)
        # strided: 3 blocks of 2 bounces and 3 bytes, 1 bounce apart at the destination
        block = 2 * cap + 3
        kit.fill(dst, 0, bytes(size))
        await p.a.transport.write(
            WriteRequest(src, 0, desc, 0, block, 799, count=3, src_stride=block,
                         dst_stride=block + cap)
        )  # fmt: skip
        for k in range(3):
            at = k * (block + cap)
            assert kit.read(dst, at, block) == data[k * block : (k + 1) * block], k
            assert kit.read(dst, at + block, cap) == bytes(cap), k
        assert sorted(imm for imm, _ in p.b.imms) == [700, 701, 702, 799]
        for node, gpu in ((p.a, src_kind == "gpu"), (p.b, dst_kind == "gpu")):
            stats = node.transport.stats()
            assert stats["bounce_largest_bytes"] <= cap, (node.name, stats)
            assert stats["bounce_bytes"] <= STREAMS * cap, (node.name, stats)
            assert (stats["bounce_largest_bytes"] > 0) == gpu, (node.name, stats)

    run(kit, body)
    for name, t in kit.nodes.items():  # every stream ended: every buffer given back
        assert t.stats()["bounce_bytes"] == 0, (name, t.stats())


def test_bounce_holds_at_most_its_cap() -> None:
    """A Bounce alone: sizes rounded to whole records, a piece over the cap refused, copies
    both ways bitwise, the pinned count back to zero at close."""
    gpu = CudaKit()
    region = gpu.region(1, 3 * MiB)
    pinned = Pinned()
    bounce = Bounce(2 * MiB + 5, timeout_s=10, pinned=pinned)
    try:
        assert bounce.cap == 2 * MiB and bounce.size == 0
        data = rand(2 * MiB, 5)
        view = bounce.buffer(2 * MiB, 0)
        view[:] = data
        assert bounce.size == 2 * MiB == pinned.now == pinned.largest
        bounce.to_device(0, region.address + MiB, 2 * MiB)
        assert gpu.read(region, MiB, 2 * MiB) == data
        gpu.fill(region, 0, rand(MiB, 6))
        assert bytes(bounce.from_device(0, region.address, MiB)) == rand(MiB, 6)
        with pytest.raises(ValueError):
            bounce.buffer(2 * MiB + 1, 0)
        assert bounce.size == 2 * MiB
    finally:
        bounce.close()
        gpu.release(region)
    assert bounce.size == 0 and pinned.now == 0


def test_a_write_whose_region_goes_mid_write_stops_there() -> None:
    """A write of three bounces into a GPU region, through a real receive sink and bounce:
    its first piece lands (bitwise), then the region is deregistered (its rank left). The
    daemon may not unmap it while the write is counted; the next piece's copy is refused
    `peer_lost`, nothing of it lands, and once the stream ends the region is drained. A
    write that begins after is refused at once. (Fails on the old code: the table had no
    count, `drained` said True at once, and the second piece was copied into the region.)"""
    from weightwire.protocol.errors import ErrorCode, PeerLostError
    from weightwire.transport.tcp import auth
    from weightwire.transport.tcp.data import Write
    from weightwire.transport.tcp.regions import RegionTable
    from weightwire.transport.tcp.sink import StreamSink

    gpu = CudaKit()
    region = gpu.region(9, 3 * MiB)
    gpu.fill(region, 0, bytes(3 * MiB))
    table = RegionTable(grant_wait_s=0.0)
    table.add(region, 7)
    table.grant(9, frozenset({"trainer"}), "")
    sink = StreamSink(table, new_bounce=lambda: Bounce(MiB, timeout_s=10))
    data = rand(3 * MiB, 9)
    write = Write(seq=1, region=9, rkey=auth.plan_rkey(7, ""), offset=0, length=3 * MiB)
    try:
        piece = sink.target(write, "trainer")
        assert len(piece) == MiB
        piece[:] = data[:MiB]
        piece = sink.piece(write, MiB)  # the first piece goes to the device
        assert gpu.read(region, 0, MiB) == data[:MiB]
        piece[:] = data[MiB : 2 * MiB]
        table.remove(9)  # the rank left: the daemon deregisters, then waits to unmap
        assert not table.drained(9, 0.0)
        with pytest.raises(PeerLostError) as err:
            sink.piece(write, 2 * MiB)
        assert err.value.code is ErrorCode.PEER_LOST
        assert gpu.read(region, MiB, 2 * MiB) == bytes(2 * MiB)  # nothing more landed
        assert not table.drained(9, 0.0)  # until the stream's thread ends (it closes)
        sink.close()
        assert table.drained(9, 0.0)
        with pytest.raises(PeerLostError):
            sink.target(write, "trainer")
        assert table.drained(9, 0.0)
    finally:
        sink.close()
        gpu.release(region)
