"""A tcp write into a GPU region goes through the receive stream's pinned bounce piece by
piece, each piece copied to the device once it is in: the region may be deregistered (its
rank left, or released its memory) between the write's lookup and its last copy. The
receive side counts such a write in its region from its lookup to its end, refuses each
later copy `peer_lost` once the region is gone (or registered again under its id), and
`drained` tells the daemon when it may unmap. The bookkeeping here, without a GPU (the
table and the transport, no memory touched); the same with real device copies through a
real bounce: test_a_write_whose_region_goes_mid_write_stops_there in test_tcp_gpu.py."""

from __future__ import annotations

import threading
import time

import pytest

from weightwire.protocol.errors import ErrorCode, PeerLostError, retryable
from weightwire.transport.base import LocalRegion
from weightwire.transport.tcp.data import Write
from weightwire.transport.tcp.regions import RegionTable
from weightwire.transport.tcp.transport import TcpTransport

RKEY = 7


def _table(*regions: LocalRegion) -> RegionTable:
    table = RegionTable(grant_wait_s=0.0)
    for r in regions:
        table.add(r, RKEY)
        table.grant(r.id, frozenset({"trainer"}), "")
    return table


def _gpu(region_id: int) -> LocalRegion:  # never touched: only its id and bounds are read
    return LocalRegion(id=region_id, kind="gpu", length=1 << 20, address=1 << 40, device=0)


def _write(region: int, length: int = 4096) -> Write:
    from weightwire.transport.tcp import auth

    return Write(seq=1, region=region, rkey=auth.plan_rkey(RKEY, ""), offset=0, length=length)


def test_a_gpu_write_is_counted_until_done_and_refused_once_its_region_goes() -> None:
    table = _table(_gpu(3))
    region, token = table.writing(_write(3), "trainer")
    assert region.id == 3 and token
    table.still(3, token)  # registered as looked up: the copy may go
    assert not table.drained(3, 0.0)  # counted even while registered
    table.remove(3)
    with pytest.raises(PeerLostError) as err:
        table.still(3, token)  # the next piece's copy is never issued
    assert err.value.code is ErrorCode.PEER_LOST and retryable(err.value)
    assert "region 3 is gone" in err.value.message
    assert not table.drained(3, 0.05)  # the write still holds it: no unmap yet
    table.done(3)
    assert table.drained(3, 0.0)
    with pytest.raises(PeerLostError):  # a write that begins after: refused at its lookup
        table.writing(_write(3), "trainer")
    assert table.drained(3, 0.0)  # and not counted


def test_a_region_registered_again_refuses_the_writes_looked_up_before() -> None:
    table = _table(_gpu(4))
    _, old = table.writing(_write(4), "trainer")
    table.remove(4)
    table.add(_gpu(4), RKEY)  # a remap keeps the id (and the tcp key), at a new address
    table.grant(4, frozenset({"trainer"}), "")
    with pytest.raises(PeerLostError):
        table.still(4, old)  # the old write's pointer is into the old mapping
    _, new = table.writing(_write(4), "trainer")
    assert new != old
    table.still(4, new)
    table.done(4)
    table.done(4)
    assert table.drained(4, 0.0)


def test_host_writes_are_not_counted_and_drained_wakes_a_waiter() -> None:
    host = LocalRegion(id=5, kind="cpu", length=4096, view=memoryview(bytearray(4096)))
    table = _table(host, _gpu(6))
    assert table.writing(_write(5), "trainer")[1] == 0  # given whole: nothing to count
    assert table.drained(5, 0.0)
    table.writing(_write(6), "trainer")
    table.writing(_write(6), "trainer")  # two streams
    table.remove(6)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(table.drained(6, 10.0)))
    waiter.start()
    table.done(6)
    time.sleep(0.05)
    assert not waited  # one write left
    table.done(6)
    waiter.join(10.0)
    assert waited == [True]


def test_the_transport_answers_drained_from_its_table() -> None:
    """The daemon asks every transport (`RegionRegistry._drained`): tcp's used to say True
    at once, and the region was unmapped under a write still copying into it."""
    t = TcpTransport("engine")
    region = _gpu(8)
    region.extra["tcp_rkey"] = RKEY  # as a remapped region keeps its key
    t.register(region)
    t.authorize(8, frozenset({"trainer"}))
    t._table.writing(_write(8), "trainer")  # what a receive stream's sink does
    t.deregister(8)
    assert not t.drained(8, 0.0)
    t._table.done(8)
    assert t.drained(8, 0.0)
