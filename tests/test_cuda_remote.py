"""A cuda transport's writes into regions of another daemon of this host (opened by their
CUDA IPC handles), let go once this daemon's plans no longer name them (their rank left,
or released its memory), without a GPU: a write into one is refused peer_lost before its
handle is opened; copies resolved before are refused at issue or fail once landed; the
allocation's mappings are closed only once no copy is in flight and no region still named
is in it; a plan naming the region again makes it writable. The same with two processes
and real GPU memory: tests/test_cuda_remote_gpu.py."""

from __future__ import annotations

import asyncio

import pytest

from weightwire.protocol.errors import ErrorCode, PeerLostError, retryable
from weightwire.protocol.regions import CudaKey, RegionDescriptor, RegionKeys
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.cuda.copies import Copy, chunks
from weightwire.transport.cuda.destinations import Destinations
from weightwire.transport.cuda.inflight import REGIONS
from weightwire.transport.cuda.prepared import CudaPrepared
from weightwire.transport.cuda.regions import CudaRegions
from weightwire.transport.cuda.remote import RemoteRegions

MiB = 1 << 20
H1, H2 = bytes(range(64)), bytes(range(1, 65))


def peer_region(region_id: int, handle: bytes = H1, node: str = "engine") -> RegionDescriptor:
    key = CudaKey(host_id="host", device_uuid="GPU-test", ipc_handle=handle, offset=0)
    return RegionDescriptor(
        id=region_id, node=node, kind="gpu", length=MiB, keys=RegionKeys(cuda=key)
    )


def test_a_region_named_no_more_is_refused_peer_lost_and_named_again_is_taken() -> None:
    remote = RemoteRegions("trainer-a")
    token, via = remote.resolve("engine", 3, H1)
    assert REGIONS.registered((via, 3), token)
    assert remote.resolve("engine", 3, H1) == (token, via)  # once per registration
    assert remote.keep([peer_region(3)]) == (False, {})  # still named: nothing changes

    changed, closing = remote.keep([])  # the plan was withdrawn: its rank left
    assert changed and closing == {H1: [(via, 3)]}
    assert not REGIONS.registered((via, 3), token)  # copies queued into it: refused
    with pytest.raises(PeerLostError) as err:
        remote.resolve("engine", 3, H1)
    assert err.value.code is ErrorCode.PEER_LOST and retryable(err.value)
    assert "region 3 is gone" in err.value.message
    assert not remote.in_use(H1)

    changed, closing = remote.keep([peer_region(3)])  # a plan names it again
    assert changed and closing == {}
    again, _ = remote.resolve("engine", 3, H1)
    assert again != token and remote.in_use(H1)
    remote.close()
    assert not REGIONS.registered((via, 3), again)


def test_an_allocation_closes_only_once_no_region_in_it_is_named() -> None:
    remote = RemoteRegions("trainer-b")
    _, via = remote.resolve("engine", 1, H1)
    remote.resolve("engine", 2, H1)  # another region of the same allocation
    changed, closing = remote.keep([peer_region(2)])
    assert changed and closing == {}  # region 2 still writes into the allocation
    with pytest.raises(PeerLostError):
        remote.resolve("engine", 1, H1)
    remote.resolve("engine", 2, H1)  # still taken
    changed, closing = remote.keep([])
    assert changed and closing == {H1: [(via, 1), (via, 2)]}  # both counted: both waited


def test_a_region_named_with_a_new_handle_lets_the_old_allocation_go() -> None:
    """A remap: the same id, new memory, a new handle (and the old one closed)."""
    remote = RemoteRegions("trainer-c")
    _, old_via = remote.resolve("engine", 4, H1)
    changed, closing = remote.keep([peer_region(4, H2)])
    assert changed and closing == {H1: [(old_via, 4)]}
    with pytest.raises(PeerLostError):
        remote.resolve("engine", 4, H1)  # a write prepared on the old plan
    _, new_via = remote.resolve("engine", 4, H2)
    assert new_via != old_via


def _copy(index: int, region_id: int, token: int, via: str) -> Copy:
    return Copy(index, 0, 0, 4096, "engine", dst_region=region_id, token=token, via=via)


def test_copies_into_a_region_let_go_are_refused_at_issue_or_fail_once_landed() -> None:
    remote = RemoteRegions("trainer-d")
    token, via = remote.resolve("engine", 5, H1)
    issued = chunks([_copy(0, 5, token, via)])[0]
    assert issued.regions == (((via, 5), token),)  # counted per writer and handle
    entered, failures = REGIONS.enter(issued)
    assert entered == [(via, 5)] and not failures
    queued = chunks([_copy(0, 5, token, via), _copy(1, 5, token, via)])[0]

    remote.keep([])  # let go while one is issued and one queued
    assert not remote.drained([(via, 5)], 0.0)  # the issued copy is still in flight
    _, refused = REGIONS.enter(queued)
    assert sorted(refused) == [0, 1] and all(isinstance(e, PeerLostError) for e in refused.values())
    REGIONS.leave(entered)  # its event seen
    landed: dict[int, BaseException] = {}
    REGIONS.withdrawn(issued, landed)
    assert isinstance(landed.get(0), PeerLostError)  # never reported landed
    assert remote.drained([(via, 5)], 0.0)


def test_let_go_closes_the_mapping_only_once_the_copies_are_done() -> None:
    from weightwire.transport.cuda.ipc import IpcMaps

    class Maps(IpcMaps):  # the real maps; which handle it was asked to let go is recorded
        def __init__(self) -> None:
            super().__init__(None)  # type: ignore[arg-type]  # nothing is opened here
            self.forgotten: list[bytes] = []

        def forget(self, handle: bytes) -> None:
            self.forgotten.append(handle)
            super().forget(handle)

    async def body() -> None:
        remote = RemoteRegions("trainer-e")
        token, via = remote.resolve("engine", 6, H1)
        entered, _ = REGIONS.enter(chunks([_copy(0, 6, token, via)])[0])
        _, closing = remote.keep([])
        maps = Maps()
        task = asyncio.create_task(remote.let_go(H1, closing[H1], maps, timeout_s=30.0))
        await asyncio.sleep(0.2)
        assert not task.done() and maps.forgotten == []  # a copy is still in flight
        REGIONS.leave(entered)
        await asyncio.wait_for(task, 10.0)
        assert maps.forgotten == [H1]

        # named again before its copies were done: the mapping is kept
        token, via = remote.resolve("engine", 7, H2)
        entered, _ = REGIONS.enter(chunks([_copy(0, 7, token, via)])[0])
        _, closing = remote.keep([])
        task = asyncio.create_task(remote.let_go(H2, closing[H2], maps, timeout_s=30.0))
        remote.keep([peer_region(7, H2)])
        remote.resolve("engine", 7, H2)
        REGIONS.leave(entered)
        await asyncio.wait_for(task, 10.0)
        assert maps.forgotten == [H1]  # H2 is written again: not closed under its writes
        remote.close()

    asyncio.run(body())


def test_let_go_waits_a_bounded_time_then_closes_all_the_same() -> None:
    """A copy that never finishes (a hung GPU) does not hold the owner's memory for ever."""
    from weightwire.transport.cuda.ipc import IpcMaps

    forgotten: list[bytes] = []

    class Maps(IpcMaps):
        def forget(self, handle: bytes) -> None:
            forgotten.append(handle)

    async def body() -> None:
        remote = RemoteRegions("trainer-g")
        token, via = remote.resolve("engine", 9, H1)
        entered, _ = REGIONS.enter(chunks([_copy(0, 9, token, via)])[0])
        _, closing = remote.keep([])
        maps = Maps(None)  # type: ignore[arg-type]
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(remote.let_go(H1, closing[H1], maps, timeout_s=0.3), 10.0)
        assert forgotten == [H1]
        assert asyncio.get_running_loop().time() - started >= 0.3
        REGIONS.leave(entered)

    asyncio.run(body())


def test_a_write_into_a_region_let_go_is_refused_before_its_handle_is_opened() -> None:
    """Through the transport's resolution: no driver is needed, since nothing is opened."""
    d = Destinations("trainer-f", "host", CudaRegions("trainer-f", "host"), {"engine": "ch"})
    d.remote.resolve("engine", 8, H1)  # written into before (on the old plan)
    d.remote.keep([])
    src = LocalRegion(id=1, kind="gpu", length=MiB, address=0x7F00_0000_0000, device=0)
    p = CudaPrepared([WriteRequest(src, 0, peer_region(8), 0, 4096, None)], None)
    d.resolve(p)
    [(index, err)] = p.failed
    assert index == 0 and isinstance(err, PeerLostError) and retryable(err)
    assert "region 8 is gone" in err.message
    assert not p.lanes
