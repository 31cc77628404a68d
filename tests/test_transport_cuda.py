"""The conformance suite on the cuda transport (GPU memory, one host). Needs a GPU: run by
scripts/gpu-suite.sh on a GPU machine; skipped elsewhere, saying why."""

from __future__ import annotations

import ctypes

import pytest

from tests.conformance.harness import TransportKit
from tests.conformance.suite import *  # noqa: F403
from weightwire.transport.base import LocalRegion, Transport
from weightwire.transport.cudadrv import available, driver

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


def test_lane_bounds_batches_in_flight(kit: TransportKit, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 2 batches in flight per device, 96 concurrent writes wait their turn
    on the loop and all land, bitwise, each immediate once."""
    from weightwire.transport.cuda import lanes

    monkeypatch.setattr(lanes, "MAX_BATCHES_IN_FLIGHT", 2)
    test_many_concurrent_writes_and_no_immediate_when_none_asked(kit)  # noqa: F405


@pytest.mark.parametrize("pinned", [True, False])
def test_host_source_pinned_or_pageable_lands(kit: TransportKit, pinned: bool) -> None:
    """A CPU-replica write: host memory to a GPU region. Pinned memory (registered) is
    issued on the loop; pageable memory (not registered) on a thread, since the driver may
    wait for such a copy. Both land bitwise, with their immediates."""

    async def body(p: Pair) -> None:  # noqa: F405
        n = 3 * MiB + 17  # noqa: F405
        data = rand(n, 11)  # noqa: F405
        host = ctypes.create_string_buffer(data, n)
        src = LocalRegion(
            id=90, kind="cpu", length=n, view=memoryview(host), address=ctypes.addressof(host)
        )
        if pinned:
            p.a.transport.register(src)
        dst, desc = p.region(p.b, 91, n)
        await p.a.transport.write(src, 0, desc, 0, n, 5)
        assert p.kit.read(dst, 0, n) == data
        assert p.b.imms == [(5, "node-a")]
        if pinned:
            p.a.transport.deregister(src.id)

    run(kit, body)  # noqa: F405
