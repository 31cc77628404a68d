"""The transport conformance suite: every transport passes these, bytes checked bitwise.

A test module runs it for one transport by defining a `kit` fixture (a TransportKit)
and importing the tests: `from tests.conformance.suite import *`.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import uvloop

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    RegionError,
    TransferError,
    retryable,
)
from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey
from weightwire.transport.base import WriteRequest

from .harness import Pair, TransportKit, with_pair

MiB = 1 << 20


def run(kit: TransportKit, body):  # type: ignore[no-untyped-def]
    return uvloop.run(asyncio.wait_for(with_pair(kit, body), 120))


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_fence_no_byte_of_a_failed_version_lands_after_the_report(kit: TransportKit) -> None:
    """A writer stopped mid-version, the destination fails the version (fence, then the
    report), the writer resumes: the destination's bytes stay as they were at the report,
    on the old path and, where writes are admitted before they land, on a new one too.
    The next version then lands bitwise."""

    async def body(p: Pair) -> None:
        n, parts = 2 * MiB, 8
        src, _ = p.region(p.a, 1, n * parts)
        dst, desc = p.region(p.b, 2, n * parts)
        old, new = rand(n * parts, 30), rand(n * parts, 31)
        p.kit.fill(src, 0, new)
        p.kit.fill(dst, 0, old)
        failed: set[int] = set()
        p.b.transport.set_admission(lambda node, imm: imm // 100 not in failed)
        pause = await p.kit.pausable(p)
        try:
            for i in range(2):  # version 1 begins: two writes land
                await p.a.transport.write(WriteRequest(src, i * n, desc, i * n, n, 100 + i))
            if pause is not None:  # the writer stops in the middle of the next write
                pause.pause(after=n)
            rest = n * (parts - 2)
            late = [
                asyncio.ensure_future(
                    p.a.transport.write(WriteRequest(src, 2 * n, desc, 2 * n, rest, 102))
                )
            ]
            await asyncio.sleep(0.3)  # posted; where the kit can pause, half sent
            if pause is not None:
                seen = p.kit.read(dst, 2 * n, rest)
                assert seen != old[2 * n :], "the write's first bytes never landed"
                assert seen != new[2 * n :], "the writer was not stopped mid-write"
            failed.add(1)
            await p.b.transport.fence("node-a", "version 1 failed")
            reported = p.kit.read(dst, 0, n * parts)  # the failure is reported now
            imms_at_report = len(p.b.imms)
            if pause is not None:
                pause.resume()
            outcomes = await asyncio.wait_for(asyncio.gather(*late, return_exceptions=True), 60)
            if pause is not None:
                assert all(isinstance(o, Exception) for o in outcomes), outcomes
            if p.kit.admits_before_landing:
                with pytest.raises(TransferError):  # the old path writes nothing any more
                    await p.a.transport.write(WriteRequest(src, 0, desc, 4 * n, n, 150))
                # nor does a new one, for the failed version
                await p.a.transport.connect("node-b", p.b.transport.endpoints())
                with pytest.raises(TransferError):
                    await p.a.transport.write(WriteRequest(src, 0, desc, 4 * n, n, 151))
            await asyncio.sleep(0.5)
            assert p.kit.read(dst, 0, n * parts) == reported, "bytes landed after the report"
            assert len(p.b.imms) == imms_at_report, p.b.imms[imms_at_report:]
            assert reported[: 2 * n] == new[: 2 * n]
        finally:
            if pause is not None:
                await pause.close()
        for attempt in range(3):  # version 2; a path the fence broke may fail it once
            await p.a.transport.connect("node-b", p.b.transport.endpoints())
            try:
                await p.a.transport.write(WriteRequest(src, 0, desc, 0, n * parts, 200))
                break
            except PeerLostError:
                assert attempt < 2, "the writer never got through again after the fence"
                await asyncio.sleep(0.5)
        assert p.kit.read(dst, 0, n * parts) == new
        assert p.b.imms[-1] == (200, "node-a")

    run(kit, body)


def test_write_lands_bitwise_at_odd_offsets_and_sizes(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, 8 * MiB)
        dst, desc = p.region(p.b, 2, 8 * MiB)
        data = rand(8 * MiB, 1)
        p.kit.fill(src, 0, data)
        p.kit.fill(dst, 0, bytes(8 * MiB))
        cases = [(0, 0, 1), (1, 3, 4095), (17, 5000, 65537), (MiB + 3, 3 * MiB + 1, 2 * MiB + 7)]
        for i, (so, do, n) in enumerate(cases):
            await p.a.transport.write(WriteRequest(src, so, desc, do, n, 1000 + i))
            assert p.kit.read(dst, do, n) == data[so : so + n], f"case {i} differs"
        assert sorted(imm for imm, _ in p.b.imms) == [1000, 1001, 1002, 1003]
        assert {node for _, node in p.b.imms} == {"node-a"}

    run(kit, body)


def test_immediate_only_after_bytes_visible(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        n, count = 4 * MiB, 16
        src, _ = p.region(p.a, 1, n * count)
        dst, desc = p.region(p.b, 2, n * count)
        data = rand(n * count, 2)
        p.kit.fill(src, 0, data)
        p.kit.fill(dst, 0, bytes(n * count))
        seen_bad: list[int] = []

        def check(imm: int, source: str) -> None:
            i = imm - 500
            if p.kit.read(dst, i * n, n) != data[i * n : (i + 1) * n]:
                seen_bad.append(i)

        p.b.on_imm_check = check
        await asyncio.gather(
            *(
                p.a.transport.write(WriteRequest(src, i * n, desc, i * n, n, 500 + i))
                for i in range(count)
            )
        )
        assert not seen_bad, f"immediates delivered before their bytes: {seen_bad}"
        assert sorted(imm for imm, _ in p.b.imms) == [500 + i for i in range(count)]
        assert p.kit.read(dst, 0, n * count) == data

    run(kit, body)


def test_many_concurrent_writes_and_no_immediate_when_none_asked(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        chunk, count = 256 * 1024, 96
        src, _ = p.region(p.a, 1, chunk * count)
        dst, desc = p.region(p.b, 2, chunk * count)
        data = rand(chunk * count, 3)
        p.kit.fill(src, 0, data)
        order = list(range(count))
        random.Random(4).shuffle(order)
        await asyncio.gather(
            *(
                p.a.transport.write(
                    WriteRequest(src, i * chunk, desc, i * chunk, chunk, i if i % 2 else None)
                )
                for i in order
            )
        )
        assert p.kit.read(dst, 0, chunk * count) == data
        assert sorted(imm for imm, _ in p.b.imms) == list(range(1, count, 2))

    run(kit, body)


def test_both_directions(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        a_mem, a_desc = p.region(p.a, 1, MiB)
        b_mem, b_desc = p.region(p.b, 2, MiB)
        p.kit.fill(a_mem, 0, rand(MiB, 5))
        p.kit.fill(b_mem, 0, rand(MiB, 6))
        await asyncio.gather(
            p.a.transport.write(WriteRequest(a_mem, 0, b_desc, 0, MiB // 2, 1)),
            p.b.transport.write(WriteRequest(b_mem, MiB // 2, a_desc, MiB // 2, MiB // 2, 2)),
        )
        assert p.kit.read(b_mem, 0, MiB // 2) == rand(MiB, 5)[: MiB // 2]
        assert p.kit.read(a_mem, MiB // 2, MiB // 2) == rand(MiB, 6)[MiB // 2 :]
        assert p.b.imms == [(1, "node-a")] and p.a.imms == [(2, "node-b")]

    run(kit, body)


def test_strided_write_lands_blocks_leaves_gaps_and_signals_once(kit: TransportKit) -> None:
    """count blocks, src_stride/dst_stride apart: each lands bitwise, the bytes between
    blocks keep what they held, and the one immediate comes after the last block."""

    async def body(p: Pair) -> None:
        n, count, ss, ds = 3 * 1024 + 5, 40, 4 * 1024, 7 * 1024 + 3
        src, _ = p.region(p.a, 1, 2 * MiB)
        dst, desc = p.region(p.b, 2, 2 * MiB)
        data, before = rand(2 * MiB, 21), rand(2 * MiB, 22)
        p.kit.fill(src, 0, data)
        p.kit.fill(dst, 0, before)
        want = bytearray(before)
        so, do = 13, 1001
        for i in range(count):
            want[do + i * ds : do + i * ds + n] = data[so + i * ss : so + i * ss + n]
        early: list[int] = []

        def check(imm: int, source: str) -> None:
            if p.kit.read(dst, 0, MiB) != bytes(want[:MiB]):
                early.append(imm)

        p.b.on_imm_check = check
        await asyncio.gather(
            p.a.transport.write(
                WriteRequest(src, so, desc, do, n, 77, count=count, src_stride=ss, dst_stride=ds)
            ),
            p.a.transport.write(WriteRequest(src, MiB, desc, MiB + 8, 4096, None, count=1)),
        )
        want[MiB + 8 : MiB + 8 + 4096] = data[MiB : MiB + 4096]
        assert p.kit.read(dst, 0, 2 * MiB) == bytes(want)
        assert p.b.imms == [(77, "node-a")]
        assert not early, "the immediate came before every block had landed"

    run(kit, body)


def test_strided_write_checks(kit: TransportKit) -> None:
    """Overlapping blocks are refused as invalid; the last block counts for the bounds."""

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        _, desc = p.region(p.b, 2, MiB)
        with pytest.raises(RegionError) as e1:
            await p.a.transport.write(
                WriteRequest(src, 0, desc, 0, 4096, 1, count=4, src_stride=4096, dst_stride=100)
            )
        assert e1.value.code is ErrorCode.INVALID
        with pytest.raises(RegionError) as e2:  # the last block ends one byte past the end
            await p.a.transport.write(
                WriteRequest(
                    src, 0, desc, 1, 4096, 1, count=4, src_stride=4096, dst_stride=(MiB - 4096) // 3
                )
            )
        assert e2.value.code is ErrorCode.OUT_OF_BOUNDS
        with pytest.raises(RegionError) as e3:
            await p.a.transport.write(
                WriteRequest(
                    src, 1, desc, 0, 4096, 1, count=2, src_stride=MiB - 4096, dst_stride=4096
                )
            )
        assert e3.value.code is ErrorCode.OUT_OF_BOUNDS
        assert p.b.imms == []

    run(kit, body)


def test_writer_side_bounds_checks(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        _, desc = p.region(p.b, 2, MiB)
        with pytest.raises(RegionError) as e1:
            await p.a.transport.write(WriteRequest(src, 0, desc, MiB - 10, 11, 1))
        assert e1.value.code is ErrorCode.OUT_OF_BOUNDS
        with pytest.raises(RegionError) as e2:
            await p.a.transport.write(WriteRequest(src, MiB - 10, desc, 0, 11, 1))
        assert e2.value.code is ErrorCode.OUT_OF_BOUNDS
        assert p.b.imms == []

    run(kit, body)


def _forged(desc: RegionDescriptor, **changes: object) -> RegionDescriptor:
    fields = {f: getattr(desc, f) for f in desc.__struct_fields__}
    fields.update(changes)
    return RegionDescriptor(**fields)  # type: ignore[arg-type]


def test_a_write_to_a_deregistered_region_fails_peer_lost(kit: TransportKit) -> None:
    """A writer still on the plan from before the destination's rank left (its region
    deregistered there) is refused `peer_lost`, retryable, naming the region; no byte, no
    immediate. The region registered again under its id takes writes again, bitwise."""

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        dst, desc = p.region(p.b, 2, MiB)
        p.kit.fill(src, 0, rand(MiB, 11))
        p.kit.fill(dst, 0, bytes(MiB))
        p.b.transport.deregister(2)
        with pytest.raises(TransferError) as err:
            await asyncio.wait_for(p.a.transport.write(WriteRequest(src, 0, desc, 0, MiB, 9)), 30)
        assert retryable(err.value), err.value
        if p.kit.precise_codes:
            assert err.value.code is ErrorCode.PEER_LOST, err.value
            assert "region 2 is gone: its rank left" in err.value.message, err.value
        assert p.b.imms == []
        assert p.kit.read(dst, 0, MiB) == bytes(MiB)
        keys = p.b.transport.register(dst)  # registered again (a remap keeps its id)
        p.b.transport.authorize(2, frozenset({p.a.name}))
        again = _forged(desc, keys=keys)
        await p.a.transport.connect("node-b", p.b.transport.endpoints())
        await asyncio.wait_for(p.a.transport.write(WriteRequest(src, 0, again, 0, MiB, 5)), 30)
        assert p.kit.read(dst, 0, MiB) == rand(MiB, 11)
        assert p.b.imms == [(5, "node-a")]

    run(kit, body)


def test_receiver_refuses_out_of_bounds_unknown_region_and_bad_key(kit: TransportKit) -> None:
    """A lying descriptor must not get bytes outside the real region, nor an immediate."""

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, 2 * MiB)
        dst, desc = p.region(p.b, 2, MiB)
        guard, _ = p.region(p.b, 3, MiB)
        p.kit.fill(src, 0, rand(2 * MiB, 7))
        p.kit.fill(dst, 0, bytes(MiB))
        p.kit.fill(guard, 0, bytes(MiB))
        forged = [
            (_forged(desc, length=2 * MiB), 0, 2 * MiB, ErrorCode.OUT_OF_BOUNDS),
            (_forged(desc, id=99), 0, 1024, ErrorCode.UNKNOWN_REGION),
        ]
        if desc.keys.tcp is not None:
            bad_key = RegionKeys(tcp=TcpKey(rkey=desc.keys.tcp.rkey ^ 1))
            forged.append((_forged(desc, keys=bad_key), 0, 1024, ErrorCode.UNAUTHORIZED))
        for lie, off, n, code in forged:
            with pytest.raises(TransferError) as err:
                await asyncio.wait_for(
                    p.a.transport.write(WriteRequest(src, 0, lie, off, n, 77)), 30
                )
            if p.kit.precise_codes:
                assert err.value.code is code, err.value
            await p.a.transport.connect("node-b", p.b.transport.endpoints())
        assert p.b.imms == []
        assert p.kit.read(guard, 0, MiB) == bytes(MiB)
        # the transport keeps serving honest writes afterwards
        await p.a.transport.write(WriteRequest(src, 0, desc, 0, MiB, 5))
        assert p.kit.read(dst, 0, MiB) == rand(2 * MiB, 7)[:MiB]
        assert p.b.imms == [(5, "node-a")]

    run(kit, body)


def test_deregistered_region_refuses_writes(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        dst, desc = p.region(p.b, 2, MiB)
        p.kit.fill(dst, 0, bytes(MiB))
        p.kit.fill(src, 0, rand(MiB, 8))
        p.b.transport.deregister(2)
        with pytest.raises(TransferError):
            await asyncio.wait_for(p.a.transport.write(WriteRequest(src, 0, desc, 0, MiB, 1)), 30)
        assert p.kit.read(dst, 0, MiB) == bytes(MiB)
        assert p.b.imms == []

    run(kit, body)


def test_lost_peer_is_a_typed_error(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        _, desc = p.region(p.b, 2, MiB)
        await p.b.transport.close()
        with pytest.raises(PeerLostError):
            for _ in range(3):  # the first write may race the teardown and still be refused
                await asyncio.wait_for(
                    p.a.transport.write(WriteRequest(src, 0, desc, 0, MiB, 1)), 30
                )
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(
                p.a.transport.write(WriteRequest(src, 0, _forged(desc, node="nobody"), 0, 16, 1)),
                30,
            )

    run(kit, body)


def test_disconnect_fails_inflight_and_reconnect_works(kit: TransportKit) -> None:
    async def body(p: Pair) -> None:
        n = 4 * MiB
        src, _ = p.region(p.a, 1, n)
        dst, desc = p.region(p.b, 2, n)
        p.kit.fill(src, 0, rand(n, 9))
        await p.a.transport.disconnect("node-b", "test")
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(p.a.transport.write(WriteRequest(src, 0, desc, 0, n, 1)), 30)
        await p.a.transport.connect("node-b", p.b.transport.endpoints())
        await p.a.transport.write(WriteRequest(src, 0, desc, 0, n, 2))
        assert p.kit.read(dst, 0, n) == rand(n, 9)
        assert p.b.imms == [(2, "node-a")]

    run(kit, body)


def test_prepared_writes_post_again_with_new_immediates(kit: TransportKit) -> None:
    """Writes prepared once and posted twice, with new source bytes and immediates: each
    post lands bitwise and signals each write once; a write refused when prepared is
    refused by every post, by name, and the others still land."""
    chunk, n = 64 * 1024 + 3, 8

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, n * chunk)
        dst, desc = p.region(p.b, 2, n * chunk)
        reqs = [WriteRequest(src, i * chunk, desc, i * chunk, chunk, None) for i in range(n)]
        reqs.append(WriteRequest(src, 0, desc, n * chunk - 10, 11, None))  # past its end
        prepared = p.a.transport.prepare(reqs)
        for post in (1, 2):
            data = rand(n * chunk, 20 + post)
            p.kit.fill(src, 0, data)
            imms = [post * 100 + i for i in range(n + 1)]
            results = await asyncio.wait_for(p.a.transport.post(prepared, imms), 30)
            assert results[:n] == [None] * n
            refused = results[n]
            assert isinstance(refused, RegionError) and refused.code is ErrorCode.OUT_OF_BOUNDS
            assert p.kit.read(dst, 0, n * chunk) == data
            assert sorted(imm for imm, _ in p.b.imms) == imms[:n]
            p.b.imms.clear()
        with pytest.raises(ValueError):
            await p.a.transport.post(prepared, imms[:-1])

    run(kit, body)


def test_prepared_writes_see_a_disconnect_and_a_reconnect(kit: TransportKit) -> None:
    """Prepared while connected: refused as a lost peer once disconnected, nothing landed;
    posted again after the reconnect, they land."""
    n = 2 * MiB

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, n)
        dst, desc = p.region(p.b, 2, n)
        p.kit.fill(src, 0, rand(n, 31))
        p.kit.fill(dst, 0, bytes(n))
        half = n // 2
        prepared = p.a.transport.prepare(
            [WriteRequest(src, i * half, desc, i * half, half, None) for i in range(2)]
        )
        await p.a.transport.disconnect("node-b", "test")
        results = await asyncio.wait_for(p.a.transport.post(prepared, [1, 2]), 30)
        assert all(isinstance(r, PeerLostError) for r in results), results
        assert p.kit.read(dst, 0, n) == bytes(n) and p.b.imms == []
        await p.a.transport.connect("node-b", p.b.transport.endpoints())
        results = await asyncio.wait_for(p.a.transport.post(prepared, [3, 4]), 30)
        assert results == [None, None]
        assert p.kit.read(dst, 0, n) == rand(n, 31)
        assert sorted(p.b.imms) == [(3, "node-a"), (4, "node-a")]

    run(kit, body)


def test_post_reports_each_write_and_write_raises(kit: TransportKit) -> None:
    """The core and its convenience agree: a refused write posted alone is reported in
    `post`'s list (post does not raise for it) and raised by `write`, with the same code,
    and nothing is delivered; an empty batch posts as nothing; a single good write posted
    with an immediate lands bitwise and delivers that immediate, not the request's."""
    n = 64 * 1024 + 1

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, n)
        dst, desc = p.region(p.b, 2, n)
        p.kit.fill(src, 0, rand(n, 41))
        p.kit.fill(dst, 0, bytes(n))
        t = p.a.transport
        bad = WriteRequest(src, 0, desc, 1, n, 5)  # one byte past the destination's end
        (refused,) = await asyncio.wait_for(t.post(t.prepare([bad]), [5]), 30)
        assert isinstance(refused, RegionError) and refused.code is ErrorCode.OUT_OF_BOUNDS
        with pytest.raises(RegionError) as raised:
            await asyncio.wait_for(t.write(bad), 30)
        assert raised.value.code is ErrorCode.OUT_OF_BOUNDS
        assert await asyncio.wait_for(t.post(t.prepare([]), []), 30) == []
        good = WriteRequest(src, 0, desc, 0, n, 6)
        assert await asyncio.wait_for(t.post(t.prepare([good]), [7]), 30) == [None]
        assert p.kit.read(dst, 0, n) == rand(n, 41)
        assert p.b.imms == [(7, "node-a")]

    run(kit, body)
