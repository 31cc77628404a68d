"""An insider on the tcp data plane: a writer with a valid ticket (authenticated as "b"),
the planned source of job A's region, aims at job B's region on the same node (with B's
key, as if captured), past the end of its own region, and with its region's key of the
plan before (keys rotate with the plan). Real transports on loopback, real sockets and
handshakes; every refusal is typed and no byte of it lands, and the writer's next honest
write lands bitwise."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from weightwire.memory.hostmem import create_shared
from weightwire.protocol.errors import ErrorCode, WeightwireError, retryable
from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.removed import RemovedRegions, unknown
from weightwire.transport.tcp import TcpTransport, auth

from .test_tcp_limits import release

N = 1 << 16


def test_a_planned_source_writes_only_where_and_with_the_key_it_was_granted() -> None:
    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1")
        await t.start(lambda imm, node: None)
        t._table.grant_wait_s = 0.2  # refusals wait this long for a plan to catch up
        w = TcpTransport("b", bind_host="127.0.0.1")
        await w.start(lambda imm, node: None)

        async def signal(peer: str, payload: bytes) -> bytes:
            return await t.on_signal("b", payload)  # the control channel authenticated "b"

        w.set_signal(signal)
        files = [create_shared(N, purpose="test") for _ in range(3)]
        try:
            src = LocalRegion(id=1, kind="cpu", length=N, view=files[0].view, fd=files[0].fd)
            src.view[:] = b"\xff" * N
            job_a = LocalRegion(id=2, kind="cpu", length=N, view=files[1].view, fd=files[1].fd)
            job_b = LocalRegion(id=3, kind="cpu", length=N, view=files[2].view, fd=files[2].fd)
            keys = {r.id: t.register(r) for r in (job_a, job_b)}
            t.authorize(2, frozenset({"b"}), "plan-a1")
            t.authorize(3, frozenset({"c"}), "plan-b1")

            def desc(region: LocalRegion, scope: str, length: int = N) -> RegionDescriptor:
                rkey = keys[region.id].tcp.rkey  # type: ignore[union-attr]
                wire_key = RegionKeys(tcp=TcpKey(rkey=auth.plan_rkey(rkey, scope)))
                return RegionDescriptor(
                    id=region.id, node="a", kind="cpu", length=length, keys=wire_key
                )

            async def write(dst: RegionDescriptor, offset: int, length: int) -> None:
                await w.connect("a", t.endpoints())
                req = WriteRequest(src, 0, dst, offset, length, 7)
                await asyncio.wait_for(w.write(req), 10)

            async def refused(dst: RegionDescriptor, offset: int, length: int) -> WeightwireError:
                with pytest.raises(WeightwireError) as err:
                    await write(dst, offset, length)
                return err.value

            await write(desc(job_a, "plan-a1"), 0, 4096)  # its own grant: lands
            assert bytes(job_a.view[:4096]) == b"\xff" * 4096
            assert bytes(job_a.view[4096:]) == bytes(N - 4096)

            e1 = await refused(desc(job_b, "plan-b1"), 0, N)  # another job's region
            assert e1.code is ErrorCode.UNAUTHORIZED, e1
            assert "b is not a planned source of region 3" in e1.message, e1

            long_a = desc(job_a, "plan-a1", 2 * N)  # a descriptor that lies about the length
            e2 = await refused(long_a, N - 4096, 8192)
            assert e2.code is ErrorCode.OUT_OF_BOUNDS, e2

            t.authorize(2, frozenset({"b"}), "plan-a2")  # a new plan: the key rotates
            e3 = await refused(desc(job_a, "plan-a1"), 8192, 4096)
            assert e3.code is ErrorCode.UNAUTHORIZED and "wrong key" in e3.message, e3

            assert bytes(job_b.view) == bytes(N), "a byte landed in another job's region"
            assert bytes(job_a.view[4096:]) == bytes(N - 4096), "a refused write landed"

            src.view[:] = bytes(range(256)) * (N // 256)
            await write(desc(job_a, "plan-a2"), 0, N)  # honest again, under the new key
            assert bytes(job_a.view) == bytes(src.view)
            assert t.stats()["refused"] >= 3, t.stats()
        finally:
            await release([w, t], files)

    uvloop.run(body())


def test_a_write_to_a_region_whose_rank_left_is_refused_as_peer_lost() -> None:
    """A writer still on the plan from before an engine rank left (its regions removed
    with it) is refused `peer_lost`, retryable, naming the region and that its rank
    left; a region that never existed is still `unknown_region`. No byte of either lands,
    and a region registered again under its id (a remap) takes writes again, bitwise."""

    async def body() -> None:
        t = TcpTransport("a", bind_host="127.0.0.1")
        await t.start(lambda imm, node: None)
        w = TcpTransport("b", bind_host="127.0.0.1")
        await w.start(lambda imm, node: None)

        async def signal(peer: str, payload: bytes) -> bytes:
            return await t.on_signal("b", payload)

        w.set_signal(signal)
        files = [create_shared(N, purpose="test") for _ in range(3)]
        try:
            src = LocalRegion(id=1, kind="cpu", length=N, view=files[0].view, fd=files[0].fd)
            src.view[:] = bytes(range(256)) * (N // 256)
            dst = LocalRegion(id=2, kind="cpu", length=N, view=files[1].view, fd=files[1].fd)

            def desc(region_id: int, rkey: int, scope: str) -> RegionDescriptor:
                wire_key = RegionKeys(tcp=TcpKey(rkey=auth.plan_rkey(rkey, scope)))
                return RegionDescriptor(id=region_id, node="a", kind="cpu", length=N, keys=wire_key)

            async def write(d: RegionDescriptor) -> None:
                await w.connect("a", t.endpoints())
                await asyncio.wait_for(w.write(WriteRequest(src, 0, d, 0, N, 7)), 10)

            async def refused(d: RegionDescriptor) -> WeightwireError:
                with pytest.raises(WeightwireError) as err:
                    await write(d)
                return err.value

            rkey = t.register(dst).tcp.rkey  # type: ignore[union-attr]
            t.authorize(2, frozenset({"b"}), "plan-1")
            old = desc(2, rkey, "plan-1")
            await write(old)  # lands
            assert bytes(dst.view) == bytes(src.view)

            dst.view[:] = bytes(N)
            t.deregister(2)  # its rank left: its regions are removed
            e1 = await refused(old)
            assert e1.code is ErrorCode.PEER_LOST and retryable(e1), e1
            assert "region 2 is gone" in e1.message and "rank left" in e1.message, e1

            e2 = await refused(desc(99, rkey, "plan-1"))  # never registered here
            assert e2.code is ErrorCode.UNKNOWN_REGION and not retryable(e2), e2
            assert "unknown region 99" in e2.message, e2
            assert bytes(dst.view) == bytes(N), "a refused write landed"

            again = LocalRegion(id=2, kind="cpu", length=N, view=files[2].view, fd=files[2].fd)
            rkey2 = t.register(again).tcp.rkey  # type: ignore[union-attr]
            t.authorize(2, frozenset({"b"}), "plan-2")
            await write(desc(2, rkey2, "plan-2"))  # the next plan: lands
            assert bytes(again.view) == bytes(src.view)
            assert bytes(dst.view) == bytes(N)
        finally:
            await w.close()
            await t.close()
            for f in files:
                f.unlink()
                f.close()

    uvloop.run(body())


def test_removed_region_ids_are_remembered_within_a_bound() -> None:
    """The last `keep` ids removed are remembered (oldest forgotten first: unknown_region
    again); an id registered again is forgotten."""
    removed = RemovedRegions(keep=2)
    for region_id in (1, 2, 3):
        removed.add(region_id)
    assert 1 not in removed and 2 in removed and 3 in removed and len(removed) == 2
    assert unknown(1, removed).code is ErrorCode.UNKNOWN_REGION
    assert unknown(3, removed).code is ErrorCode.PEER_LOST
    removed.discard(3)
    assert unknown(3, removed).code is ErrorCode.UNKNOWN_REGION
