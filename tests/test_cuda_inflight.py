"""The cuda lanes' count of copies in flight into regions of this process
(`transport/cuda/inflight.py`), without a GPU: a copy resolved before its region was
deregistered (or registered again under its id) is refused peer_lost; one issued before
fails once it finishes; the region is drained only when every issued copy has been seen
finished, and a waiter is woken then, or told no at its timeout. The same on a GPU, with
real copies racing a deregistration: test_transport_cuda.py."""

from __future__ import annotations

import threading
import time

from weightwire.protocol.errors import ErrorCode, PeerLostError, retryable
from weightwire.transport.cuda.copies import Chunk, Copy, chunks
from weightwire.transport.cuda.inflight import InFlight

KEY = ("node-b", 2)


def copy(index: int, token: int, region: int = 2, node: str = "node-b") -> Copy:
    return Copy(index, 0, 0, 4096, node, dst_region=region, token=token)


def batch(*copies: Copy) -> Chunk:
    """The copies as a lane issues them: one chunk, its regions found once."""
    [chunk] = chunks(copies)
    return chunk


def test_copies_into_a_deregistered_region_are_refused_peer_lost_not_counted() -> None:
    f = InFlight()
    token = f.register(KEY)
    other = f.register(("node-b", 3))
    f.deregister(KEY)  # its rank left while the batch waited on its lane
    entered, refused = f.enter(batch(copy(0, token), copy(1, other, region=3), copy(2, 0)))
    assert entered == [("node-b", 3)]  # another process's memory (token 0): not counted
    assert set(refused) == {0}
    err = refused[0]
    assert isinstance(err, PeerLostError) and err.code is ErrorCode.PEER_LOST and retryable(err)
    assert "region 2 is gone" in err.message
    assert f.issued(KEY) == 0 and f.drained(KEY, 0.0)
    assert f.issued(("node-b", 3)) == 1 and not f.drained(("node-b", 3), 0.0)


def test_a_copy_resolved_before_the_region_was_registered_again_is_refused() -> None:
    """A remap keeps the region's id and moves its memory: the old pointer is stale."""
    f = InFlight()
    old = f.register(KEY)
    f.deregister(KEY)
    new = f.register(KEY)
    assert new != old
    _, refused = f.enter(batch(copy(0, old)))
    assert set(refused) == {0}
    entered, refused = f.enter(batch(copy(0, new), copy(1, new)))
    assert entered == [KEY] and refused == {}  # a batch counts once per region
    assert f.issued(KEY) == 1


def test_issued_copies_fail_once_finished_if_their_region_went_meanwhile() -> None:
    f = InFlight()
    token = f.register(KEY)
    copies = batch(copy(0, token), copy(1, token), copy(2, 0))
    entered, refused = f.enter(copies)
    assert entered == [KEY] and refused == {}
    f.deregister(KEY)  # while the batch is on the stream
    failures: dict[int, BaseException] = {1: RuntimeError("failed on its own")}
    f.withdrawn(copies, failures)
    assert isinstance(failures[0], PeerLostError)  # its bytes went into memory now gone
    assert isinstance(failures[1], RuntimeError)  # its own failure kept
    assert 2 not in failures  # another process's memory: not this process's to say
    kept: dict[int, BaseException] = {}
    token = f.register(KEY)
    f.withdrawn(batch(copy(0, token)), kept)  # still registered under its token: landed
    assert kept == {}


def test_drained_waits_for_every_issued_copy_and_times_out_otherwise() -> None:
    f = InFlight()
    token = f.register(KEY)
    first, _ = f.enter(batch(copy(0, token)))
    second, _ = f.enter(batch(copy(1, token)))
    f.deregister(KEY)
    assert f.issued(KEY) == 2
    t0 = time.monotonic()
    assert not f.drained(KEY, 0.05)  # bounded: no for an answer at its timeout
    assert time.monotonic() - t0 >= 0.05
    f.leave(first)
    assert not f.drained(KEY, 0.0)
    woke: list[tuple[bool, float]] = []

    def waiter() -> None:
        start = time.monotonic()
        woke.append((f.drained(KEY, 30.0), time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)
    assert woke == []  # still waiting for the second copy
    f.leave(second)
    thread.join(10)
    [(drained, waited)] = woke
    assert drained and waited < 10, woke
    assert f.issued(KEY) == 0 and f.drained(KEY, 0.0)
