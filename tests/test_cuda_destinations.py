"""Where the cuda transport's writes go, without a GPU: a write into a region of this
process that was deregistered (its rank left, or released it) is refused peer_lost,
retryable, as tcp and verbs refuse it (`transport/removed.py`); one into a region never
registered, unknown_region; a region registered again under its id takes writes again.
Resolving a write into memory of this process needs no driver. Run anywhere; the same
case on real GPU memory is the conformance suite's, in test_transport_cuda.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError, retryable
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.cuda import neighbours
from weightwire.transport.cuda.destinations import Destinations
from weightwire.transport.cuda.prepared import CudaPrepared
from weightwire.transport.cuda.regions import CudaRegions
from weightwire.transport.cuda.transport import CudaTransport

MiB = 1 << 20
BASE = 0x7F00_0000_0000  # a device pointer; nothing is copied


def gpu_region(region_id: int, address: int = BASE) -> LocalRegion:
    return LocalRegion(
        id=region_id,
        kind="gpu",
        length=MiB,
        address=address,
        device=0,
        extra={"ipc_handle": bytes(range(64)), "ipc_offset": 0, "device_uuid": "GPU-test"},
    )


def write_into(node: str, region_id: int) -> WriteRequest:
    src = gpu_region(1, BASE + 16 * MiB)
    dst = RegionDescriptor(id=region_id, node=node, kind="gpu", length=MiB)
    return WriteRequest(src, 0, dst, 4096, 8192, None)


def resolved(d: Destinations, r: WriteRequest) -> tuple[int, BaseException | None]:
    """(destination pointer, or 0 when refused; the refusal)."""
    p = CudaPrepared([r], None)
    d.resolve(p)
    if p.failed:
        return 0, p.failed[0][1]
    [(_, [chunk], _)] = p.lanes
    return chunk.copies[0].dst, None


def test_a_deregistered_region_is_refused_peer_lost_and_taken_again_once_registered() -> None:
    regions = CudaRegions("node-b", "host")
    d = Destinations("node-b", "host", regions, {})
    regions.register(None, gpu_region(2))
    assert resolved(d, write_into("node-b", 2)) == (BASE + 4096, None)

    regions.deregister(None, 2)  # its engine rank left
    _, err = resolved(d, write_into("node-b", 2))
    assert isinstance(err, PeerLostError) and retryable(err), err
    assert err.code is ErrorCode.PEER_LOST
    assert "region 2 is gone: its rank left" in err.message, err

    _, err = resolved(d, write_into("node-b", 7))  # never registered: not retryable
    assert isinstance(err, RegionError) and err.code is ErrorCode.UNKNOWN_REGION, err
    assert not retryable(err) and "unknown region 7 of node-b" in err.message

    regions.register(None, gpu_region(2, BASE + 32 * MiB))  # a remap keeps the id
    assert resolved(d, write_into("node-b", 2)) == (BASE + 32 * MiB + 4096, None)


@pytest.fixture
def neighbour() -> Iterator[CudaTransport]:
    """A cuda transport of this process (not started: its regions are all it needs)."""
    t = CudaTransport("node-c")
    neighbours.add("node-c", t)
    try:
        yield t
    finally:
        neighbours.remove("node-c")


def test_a_neighbours_deregistered_region_is_refused_peer_lost(neighbour: CudaTransport) -> None:
    """The destination is another cuda transport of this process (its own removed ids)."""
    d = Destinations("node-b", "host", CudaRegions("node-b", "host"), {"node-c": "unused"})
    neighbour.register(gpu_region(3))
    assert resolved(d, write_into("node-c", 3)) == (BASE + 4096, None)
    neighbour.deregister(3)
    _, err = resolved(d, write_into("node-c", 3))
    assert isinstance(err, PeerLostError) and "region 3 is gone" in err.message, err
    _, err = resolved(d, write_into("node-c", 4))
    assert isinstance(err, RegionError) and err.code is ErrorCode.UNKNOWN_REGION, err


def test_an_allocation_is_let_go_once_no_region_in_it_is_left() -> None:
    """Once a deregistered region is drained, the transport closes its own peer mappings
    of the region's allocation (by its IPC handle), but only when no other region in the
    same allocation is registered or still leaving; VMM regions have no handle."""
    regions = CudaRegions("node-b", "host")
    regions.register(None, gpu_region(2))
    regions.register(None, gpu_region(3, BASE + MiB))  # the same allocation (handle)
    vmm = gpu_region(4)
    vmm.extra = {"vmm_base": BASE, "ipc_offset": 0, "device_uuid": "GPU-test"}
    regions.register(None, vmm)
    regions.deregister(None, 2)
    assert regions.drained(2) == b""  # region 3 still uses it
    regions.deregister(None, 3)
    assert regions.drained(3) == bytes(range(64))
    assert regions.drained(3) == b""  # once
    regions.deregister(None, 4)
    assert regions.drained(4) == b""

    regions.register(None, gpu_region(5))
    regions.register(None, gpu_region(6))
    regions.deregister(None, 5)
    regions.deregister(None, 6)
    assert regions.drained(5) == b""  # region 6's copies may still go through it
    assert regions.drained(6) == bytes(range(64))
