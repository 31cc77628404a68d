"""The conformance suite on the verbs transport, on real (Soft-RoCE) RDMA devices, plus the
verbs-only behaviour: error completions and queue-pair rebuilds, send-queue accounting,
two lanes, the polling-thread fallback. Host memory regions; two transports in one process.

Runs inside the Soft-RoCE VM (`make test-rdma`: scripts/rdma-vm.sh), on the rxe1/rxe2 pair
(two devices joined by a veth) and on rxe0 (loopback); elsewhere it is skipped, saying why.
No torch here: the VM imports it slowly.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.harness import Pair, TransportKit
from tests.conformance.suite import *  # noqa: F403
from tests.conformance.suite import rand, run
from weightwire.memory.hostmem import SharedFile, create_shared
from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError, TransferError
from weightwire.transport.base import LocalRegion, Transport, WriteRequest
from weightwire.transport.verbs import VerbsTransport, available, discover
from weightwire.transport.verbs.transport import FAULT_ENV

OK, WHY = available()
pytestmark = pytest.mark.rdma
if not OK:
    pytest.skip(f"no RDMA device ({WHY}); make test-rdma runs these", allow_module_level=True)
MiB = 1 << 20


def _devices() -> list[str]:
    env = os.environ.get("WEIGHTWIRE_RDMA_DEVICES", "").split()
    return env or ([d.name for d in discover()] if OK else [])


PAIR = os.environ.get("WEIGHTWIRE_RDMA_PAIR", "").split()
LOOP = _devices()[:1]
CONFIGS = {
    "pair": (PAIR[0], PAIR[1]) if len(PAIR) == 2 else None,
    "loopback": (LOOP[0], LOOP[0]) if LOOP else None,
}


class VerbsKit(TransportKit):
    """node-a and node-b are two VerbsTransports of this process; their bring-up
    signals go straight to each other (the daemons carry them over the mesh)."""

    name = "verbs"
    precise_codes = True  # the owner checks each descriptor once: exact codes
    admits_before_landing = False  # one-sided: immediates come after the bytes

    def __init__(self, dev_a: str, dev_b: str, **opts: Any) -> None:
        self.devices = {"node-a": [dev_a], "node-b": [dev_b]}
        self.opts: dict[str, Any] = {
            "chunk_bytes": MiB,  # small enough that writes here are chains of WRs
            "wr_per_post": 4,
            "qps_per_peer": 2,
            "send_depth": 64,
            "recv_depth": 16,
            "stall_timeout_s": 10.0,
            "signal_timeout_s": 10.0,
            **opts,
        }
        self.nodes: dict[str, VerbsTransport] = {}
        self._files: dict[int, SharedFile] = {}

    def make(self, node: str) -> Transport:
        opts = dict(self.opts)
        devices = opts.pop("devices", {}).get(node) or self.devices[node]
        t = VerbsTransport(node, devices=devices, **opts)
        self.nodes[node] = t

        async def signal(peer: str, payload: bytes) -> bytes:
            other = self.nodes.get(peer)
            if other is None:
                raise PeerLostError(f"no node {peer}")
            return await other.on_signal(node, payload)

        t.set_signal(signal)
        return t

    def region(self, region_id: int, length: int) -> LocalRegion:
        f = create_shared(length, purpose="test")
        f.unlink()
        self._files[region_id * 1000 + len(self._files)] = f
        return LocalRegion(
            id=region_id, kind="cpu", length=length, view=f.view, fd=f.fd, address=f.address
        )


@pytest.fixture(params=[k for k, v in CONFIGS.items() if v is not None] or ["none"])
def kit(request: pytest.FixtureRequest) -> TransportKit:
    devs = CONFIGS.get(request.param)
    if devs is None:
        pytest.skip("no RDMA device pair")
    return VerbsKit(*devs)


def pair_kit(**opts: Any) -> VerbsKit:
    devs = CONFIGS["pair"] or CONFIGS["loopback"]
    assert devs is not None
    return VerbsKit(*devs, **opts)


# --- verbs-only behaviour ------------------------------------------------------------


@pytest.fixture
def fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(path))
    yield path


def test_error_completion_fails_inflight_writes_and_the_qp_is_rebuilt(fault_file: Path) -> None:
    """A write the NIC refuses (a wrong rkey that got past the descriptor check) fails with
    an error naming the peer; so do the writes behind it on that queue pair; no immediate
    of theirs arrives; the queue pair pair is rebuilt and the next writes land."""
    kit = pair_kit(qps_per_peer=1)

    async def body(p: Pair) -> None:
        n = 2 * MiB
        src, _ = p.region(p.a, 1, 4 * n)
        dst, desc = p.region(p.b, 2, 4 * n)
        data = rand(4 * n, 11)
        p.kit.fill(src, 0, data)
        p.kit.fill(dst, 0, bytes(4 * n))
        await p.a.transport.write(
            WriteRequest(src, 0, desc, 0, 4096, 1)
        )  # link up, descriptor checked
        fault_file.write_text("rkey")
        results = await asyncio.gather(
            *(
                p.a.transport.write(WriteRequest(src, i * n, desc, i * n, n, 100 + i))
                for i in range(4)
            ),
            return_exceptions=True,
        )
        assert isinstance(results[0], RegionError), results
        assert results[0].code is ErrorCode.UNAUTHORIZED
        assert "node-b" in results[0].message
        for r in results[1:]:
            assert isinstance(r, TransferError) and "node-b" in r.message, results
        assert not fault_file.exists()
        await asyncio.sleep(0.2)
        assert [imm for imm, _ in p.b.imms] == [1], "an immediate of a failed write arrived"
        deadline = time.monotonic() + 10
        while p.a.transport.stats()["qp_rebuilds"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stats = p.a.transport.stats()
        assert stats["qp_rebuilds"] == 1 and stats["error_completions"] >= 1, stats
        await asyncio.gather(
            *(
                p.a.transport.write(WriteRequest(src, i * n, desc, i * n, n, 200 + i))
                for i in range(4)
            )
        )
        assert p.kit.read(dst, 0, 4 * n) == data
        assert sorted(imm for imm, _ in p.b.imms) == [1, 200, 201, 202, 203]
        assert p.a.transport.stats()["links"] == 1

    run(kit, body)


def test_send_queue_slots_are_counted_for_unsignaled_wrs() -> None:
    """A small send queue, small chunks: one write is far more WRs than the queue holds.
    rxe would accept an overfull queue; real NICs do not, so the transport never posts
    more than the queue depth (counted until a later signaled WR completes)."""
    kit = pair_kit(send_depth=8, wr_per_post=3, chunk_bytes=64 * 1024, qps_per_peer=1)

    async def body(p: Pair) -> None:
        n = 4 * MiB
        src, _ = p.region(p.a, 1, 2 * n)
        dst, desc = p.region(p.b, 2, 2 * n)
        data = rand(2 * n, 12)
        p.kit.fill(src, 0, data)
        await asyncio.gather(
            p.a.transport.write(WriteRequest(src, 0, desc, 0, n, 7)),
            *(
                p.a.transport.write(
                    WriteRequest(src, n + i * (n // 8), desc, n + i * (n // 8), n // 8, 8 + i)
                )
                for i in range(8)
            ),
        )
        assert p.kit.read(dst, 0, 2 * n) == data
        stats = p.a.transport.stats()
        assert stats["max_sq_used"] <= 8, stats
        assert stats["wrs_posted"] == 2 * n // (64 * 1024), stats
        assert stats["posts"] >= stats["wrs_posted"] // 3, stats
        assert sorted(imm for imm, _ in p.b.imms) == list(range(7, 16))

    run(kit, body)


def test_completions_by_polling_thread() -> None:
    kit = pair_kit(completions="thread")

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, 3 * MiB)
        dst, desc = p.region(p.b, 2, 3 * MiB)
        p.kit.fill(src, 0, rand(3 * MiB, 13))
        await asyncio.gather(
            p.a.transport.write(WriteRequest(src, 0, desc, 0, 2 * MiB + 5, 1)),
            p.a.transport.write(WriteRequest(src, 2 * MiB + 5, desc, 2 * MiB + 5, MiB - 5, 2)),
        )
        assert p.kit.read(dst, 0, 3 * MiB) == rand(3 * MiB, 13)
        # the two transports' polling threads race: b's may hand its immediate to the loop
        # after a's send completion resolved the write (channel mode processes both at once)
        deadline = time.monotonic() + 5
        while len(p.b.imms) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert sorted(imm for imm, _ in p.b.imms) == [1, 2]

    run(kit, body)


@pytest.mark.skipif(CONFIGS["pair"] is None, reason="needs two RDMA devices that reach each other")
def test_two_lanes_stripe_one_write_over_two_nics() -> None:
    """Host memory on two NICs (verbs_host_nics = 2): each region has a key per NIC, lane i
    writes from the i-th local NIC to the i-th remote one, each stripe with its immediate."""
    a, b = PAIR
    kit = pair_kit(devices={"node-a": [a, b], "node-b": [b, a]}, host_nics=2)

    async def body(p: Pair) -> None:
        assert p.a.transport.lanes("") == 2
        n = 6 * MiB
        src, _ = p.region(p.a, 1, n)
        dst, desc = p.region(p.b, 2, n)
        assert [k.device for k in desc.keys.verbs] == [b, a]
        data = rand(n, 14)
        p.kit.fill(src, 0, data)
        half = n // 2
        await asyncio.gather(
            p.a.transport.write(WriteRequest(src, 0, desc, 0, half, 42, lane=0)),
            p.a.transport.write(WriteRequest(src, half, desc, half, n - half, 42, lane=1)),
        )
        assert p.kit.read(dst, 0, n) == data
        assert p.b.imms == [(42, "node-a"), (42, "node-a")]
        assert p.a.transport.stats()["links"] == 2

    run(kit, body)


def test_chunks_never_exceed_the_ports_max_message() -> None:
    kit = pair_kit(chunk_bytes=1 << 30, qps_per_peer=1)

    async def body(p: Pair) -> None:
        n = 20 * MiB
        src, _ = p.region(p.a, 1, n)
        dst, desc = p.region(p.b, 2, n)
        p.kit.fill(src, 0, rand(n, 15))
        await p.a.transport.write(WriteRequest(src, 0, desc, 0, n, 3))
        assert p.kit.read(dst, 0, n) == rand(n, 15)
        t = p.a.transport
        assert isinstance(t, VerbsTransport)
        max_msg = t.infos[0].max_msg_sz
        assert t.stats()["wrs_posted"] == -(-n // max_msg)

    run(kit, body)


def test_gid_is_roce_v2_ipv4_mapped() -> None:
    for info in discover(_devices()):
        assert info.gid.startswith("0000:0000:0000:0000:0000:ffff:"), info
        assert info.gid_index > 0 and info.ethernet, info


def test_registration_from_threads_while_writing() -> None:
    """The daemon registers regions on worker threads while the loop writes."""
    kit = pair_kit()

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, 4 * MiB)
        dst, desc = p.region(p.b, 2, 4 * MiB)
        p.kit.fill(src, 0, rand(4 * MiB, 16))
        extra = [p.kit.region(10 + i, 2 * MiB) for i in range(6)]
        p.regions.extend(extra)
        keys: list[Any] = [None] * len(extra)
        errors: list[BaseException] = []

        def reg(i: int) -> None:
            try:
                keys[i] = p.b.transport.register(extra[i])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reg, args=(i,)) for i in range(len(extra))]
        for th in threads:
            th.start()
        await p.a.transport.write(WriteRequest(src, 0, desc, 0, 4 * MiB, 9))
        await asyncio.to_thread(lambda: [th.join(30) for th in threads])
        assert not errors, errors
        rkeys = {k.verbs[0].rkey for k in keys}
        assert len(rkeys) == len(extra)
        assert p.kit.read(dst, 0, 4 * MiB) == rand(4 * MiB, 16)

    run(kit, body)


def test_unregistered_source_and_missing_keys_are_refused() -> None:
    kit = pair_kit()

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        _, desc = p.region(p.b, 2, MiB)
        stray = p.kit.region(5, MiB)
        p.regions.append(stray)
        with pytest.raises(RegionError):
            await p.a.transport.write(WriteRequest(stray, 0, desc, 0, 16, 1))
        from weightwire.protocol.regions import RegionKeys

        bare = type(desc)(id=desc.id, node=desc.node, kind="cpu", length=MiB, keys=RegionKeys())
        assert not p.a.transport.accepts(src, bare)
        with pytest.raises(RegionError):
            await p.a.transport.write(WriteRequest(src, 0, bare, 0, 16, 1))
        assert p.b.imms == []

    run(kit, body)


def test_zero_length_write_and_the_largest_immediate() -> None:
    kit = pair_kit()

    async def body(p: Pair) -> None:
        src, _ = p.region(p.a, 1, MiB)
        dst, desc = p.region(p.b, 2, MiB)
        p.kit.fill(src, 0, rand(MiB, 17))
        p.kit.fill(dst, 0, bytes(MiB))
        await p.a.transport.write(WriteRequest(src, 5, desc, 7, 0, 0xFFFFFFFF))
        await p.a.transport.write(WriteRequest(src, 0, desc, 0, 0, None))
        await p.a.transport.write(WriteRequest(src, MiB - 1, desc, MiB - 1, 1, 0))
        assert p.b.imms == [(0xFFFFFFFF, "node-a"), (0, "node-a")]
        assert p.kit.read(dst, 0, MiB) == bytes(MiB - 1) + rand(MiB, 17)[-1:]

    run(kit, body)
