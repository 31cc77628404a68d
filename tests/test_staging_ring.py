"""Bounded staging: a trainer packs into a ring of bucket slots, each reused only once
every write from it has finished (the daemon reports each bucket's end). Real daemons on
tcp (own network namespaces when root; the trainer host's link throttled there, so that
writes are slower than packing and the ring really waits), every byte checked bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightwire.cli.status import render
from weightwire.client import Engine, Trainer
from weightwire.client.ring import slot_wait
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, TimeoutError_, WeightwireError
from weightwire.protocol.local import BeginVersion
from weightwire.protocol.plan import Bucket, PackOp, RankPlan, staging_ring
from weightwire.protocol.tensors import Box, Copy

from .conftest import FAST, NETNS, NETNS_WHY
from .ranks.big_trainer import COLS, ROWS, weights

HERE = Path(__file__).parent
BUCKET = 1 << 20


def _plan(spans: list[list[tuple[int, int]]]) -> RankPlan:
    """A plan whose bucket i packs (offset, nbytes) pairs spans[i] (none: zero-copy)."""
    buckets = tuple(
        Bucket(
            index=i,
            packs=tuple(
                PackOp(source="w", box=Box.full((n,)), transform=Copy(), staging_offset=o, nbytes=n)
                for o, n in packs
            ),
        )
        for i, packs in enumerate(spans)
    )
    end = max((o + n for packs in spans for o, n in packs), default=0)
    return RankPlan(plan_hash="h", rank=0, staging_bytes=end, buckets=buckets)


def test_ring_geometry() -> None:
    # five buckets, one zero-copy (no slot), offsets as the planner aligns them (16 B)
    plan = _plan(
        [[(0, 1000), (1008, 40)], [(1056, 600)], [], [(1664, 900), (2576, 16)], [(2592, 100)]]
    )
    ring = staging_ring(plan, 2)
    assert ring.slots == 2 and ring.slot_bytes == 1280 and ring.nbytes == 2560
    assert ring.slot == (0, 1, -1, 0, 1)
    assert ring.reuse == (-1, -1, -1, 0, 1)  # the bucket that held the slot before
    for b in plan.buckets:
        if not b.packs:
            continue
        lo, hi = ring.slot[b.index] * ring.slot_bytes, (ring.slot[b.index] + 1) * ring.slot_bytes
        for op in b.packs:  # inside its slot, and aligned as planned
            moved = op.staging_offset + ring.shift[b.index]
            assert lo <= moved and moved + op.nbytes <= hi
            assert moved % 256 == op.staging_offset % 256
    # the whole send: asked for, or a ring as large as it
    for slots in (0, 4, 9):
        whole = staging_ring(plan, slots)
        assert whole.slots == 0 and whole.nbytes == plan.staging_bytes
        assert set(whole.shift) == {0} and set(whole.reuse) == {-1}
    assert staging_ring(_plan([[], []]), 1).nbytes == 0  # all zero-copy: no staging at all


def test_a_slot_waits_past_buckets_packed_in_place() -> None:
    # six buckets in a ring of 2: slots 0 1 0 1 0 1, each reusing the one two before
    plan = _plan([[(i * 1024, 1000)] for i in range(6)])
    ring = staging_ring(plan, 2)
    assert ring.reuse == (-1, -1, 0, 1, 2, 3)
    assert [slot_wait(ring, b, set()) for b in range(6)] == [-1, -1, 0, 1, 2, 3]
    # 2 and 3 packed in place (colocated) never touched their slots: 4 waits for 0, 5 for 1
    assert [slot_wait(ring, b, {2, 3}) for b in (4, 5)] == [0, 1]
    assert slot_wait(ring, 4, {0, 2}) == -1  # nothing staged in its slot before it


@pytest.fixture(scope="module")
def ring_cluster() -> Iterator[LocalCluster]:
    small = {"bucket-bytes": str(BUCKET), "max-write-bytes": str(BUCKET // 4)}
    c = LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **small})
    c.start()
    if c.net is not None:
        c.net.throttle(0, 400)  # 50 MB/s out of the trainers' host
    c.wait_joined()
    yield c
    assert c.stop() == [0, 0], f"logs in {c.workdir}"


def publishing(c: LocalCluster, job: str) -> dict[str, object]:
    return next(p for p in fetch(c.daemons[0].socket)["publishing"] if p["job"] == job)


def _engine(c: LocalCluster, job: str, rows: int) -> tuple[Engine, torch.Tensor]:
    """An engine rank on daemon 1 receiving `w` (`rows` x COLS float32, zeroed)."""
    dst = torch.zeros(rows, COLS)
    eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=60)
    eng.register({"w": dst})
    return eng, dst


def _trainer(c: LocalCluster, job: str, slots: int) -> Trainer:
    """A trainer rank on daemon 0 with a staging ring of `slots` slots (0: none)."""
    return Trainer(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=60, staging_buckets=slots)


def test_a_send_larger_than_the_ring_lands_bitwise_version_after_version(
    ring_cluster: LocalCluster,
) -> None:
    job = "ring-bitwise"
    rows = 384  # 6 MiB of float32: 6 buckets through 2 slots
    eng, dst = _engine(ring_cluster, job, rows)
    w = weights(0)[:rows].clone()
    with _trainer(ring_cluster, job, 2) as tr:
        tr.register({"w": w})
        plan = tr.prepare()
        ring = tr.ring()
        assert len(plan.buckets) == 6 and ring.slots == 2
        assert tr.staging_bytes == ring.nbytes == 2 * ring.slot_bytes
        assert ring.slot_bytes < BUCKET + 4096 and 3 * tr.staging_bytes < plan.staging_bytes + 8192
        for version in (1, 2, 3):
            w.copy_(weights(version)[:rows])
            stats = tr.publish(version)
            eng.wait(version)
            assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8)), f"v{version}"
            assert stats.nbytes == w.nbytes
            b = stats.buckets
            for k in range(2, len(b)):  # packed only after the slot's last bucket landed
                assert b[k].prepare_start >= b[k - 2].landed > 0, (version, k)
        status = publishing(ring_cluster, job)
        assert status["staging_buckets"] == 2 and status["staging_bytes"] == ring.nbytes
        text = render(fetch(ring_cluster.daemons[0].socket))  # `weightwire status`
        assert f"staging {ring.nbytes / 1e9:.3f} GB, ring of 2" in text, text
    eng.close()


def test_the_whole_send_when_asked_or_when_the_ring_would_not_be_smaller(
    ring_cluster: LocalCluster,
) -> None:
    job = "ring-whole"
    eng, dst = _engine(ring_cluster, job, 384)
    w = weights(5)[:384].clone()
    with _trainer(ring_cluster, job, 0) as tr:
        tr.register({"w": w})
        plan = tr.prepare()
        assert tr.ring().slots == 0 and tr.staging_bytes == plan.staging_bytes
        assert tr.ring(plan).nbytes == plan.staging_bytes
        tr.staging_buckets = 6  # as many slots as buckets: no ring
        assert tr.ring().slots == 0
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, w)
        assert publishing(ring_cluster, job)["staging_buckets"] == 0
    eng.close()


@pytest.mark.skipif(not NETNS, reason=f"needs a throttled link (namespaces): {NETNS_WHY}")
def test_a_rank_killed_mid_ring_never_completes_and_the_next_one_lands(
    ring_cluster: LocalCluster,
) -> None:
    job = "ring-killed"
    eng, dst = _engine(ring_cluster, job, ROWS)
    done: list[object] = []
    eng.on_version(done.append)
    sock = ring_cluster.daemons[0].socket
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, str(HERE / "ranks" / "big_trainer.py"), sock, job, "2"]
    doomed = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert doomed.stdin is not None and doomed.stdout is not None
    try:
        assert json.loads(doomed.stdout.readline())["event"] == "ready"
        doomed.stdin.write("1\n")
        doomed.stdin.flush()
        deadline = time.monotonic() + 30
        while True:  # 48 buckets, 2 slots, 50 MB/s: the ring is full and waiting
            p = publishing(ring_cluster, job)
            if p["version"] == 1 and p["state"] == "writing" and p["buckets_posted"] >= 2:
                break
            assert time.monotonic() < deadline, p
            time.sleep(0.02)
        assert p["staging_buckets"] == 2 and p["buckets_posted"] < p["buckets"]
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
    with pytest.raises(WeightwireError, match="disconnected mid-version"):
        eng.wait(1, timeout_s=15)
    assert not any(getattr(e, "version", None) == 1 for e in done), "version 1 completed"
    w = weights(2)
    with _trainer(ring_cluster, job, 2) as tr:
        tr.register({"w": w})
        tr.publish(2)
    eng.wait(2, timeout_s=30)
    assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8))
    eng.close()


@pytest.mark.skipif(not NETNS, reason=f"needs a throttled link (namespaces): {NETNS_WHY}")
def test_a_version_failing_mid_ring_ends_the_wait_for_a_slot(ring_cluster: LocalCluster) -> None:
    """The engine leaves while the trainer waits for a slot: the version fails, and the
    publish raises at once with the cause instead of waiting out its timeout."""
    job = "ring-fails"
    eng, _ = _engine(ring_cluster, job, ROWS)
    with _trainer(ring_cluster, job, 2) as tr:
        tr.register({"w": weights(1)})
        tr.prepare()
        out: dict[str, object] = {}

        def publish() -> None:
            try:
                tr.publish(1)
            except WeightwireError as exc:
                out["error"], out["t"] = exc, time.monotonic()

        thread = threading.Thread(target=publish)
        thread.start()
        deadline = time.monotonic() + 30
        while True:
            p = publishing(ring_cluster, job)
            if p["version"] == 1 and p["state"] == "writing" and p["buckets_posted"] >= 2:
                break
            assert time.monotonic() < deadline, p
            time.sleep(0.02)
        left = time.monotonic()
        eng.close()
        thread.join(30)
        assert not thread.is_alive() and "error" in out, out
        assert float(out["t"]) - left < 15, out  # type: ignore[arg-type]
        assert publishing(ring_cluster, job)["buckets_posted"] < p["buckets"]


class _Sent:
    """Stands in for the daemon connection: records what the poster sends, when."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, ...]] = []

    def send(self, msg: object) -> None:
        from weightwire.protocol.local import BucketReady

        assert isinstance(msg, BucketReady)
        self.posted.append((msg.bucket, *msg.more))


class _PackEvent:
    """A bucket's packing, done once `done` is set (as a CUDA event's query())."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10)


def test_buckets_packed_while_waiting_for_a_slot_are_posted_before_it_comes_free() -> None:
    # Ring of 2: bucket 0 is posted, bucket 1 is still packing, the trainer waits for
    # bucket 0's slot to pack bucket 2. Bucket 1 must reach the daemon as soon as it is
    # packed, not once bucket 0 has landed: bucket 0 landing may wait on nothing else here
    # but the ring would move one bucket at a time if it did.
    from weightwire.client.posting import Poster
    from weightwire.client.ring import Landed

    conn = _Sent()
    poster = Poster(conn, version=1)  # type: ignore[arg-type]
    landed = Landed()
    poster.post(0, torch.device("cpu"), time.time())  # no event: packed at once
    assert conn.posted == [(0,)]
    packing = _PackEvent()
    poster._pending.append((1, packing))  # type: ignore[arg-type]  # as post() on a GPU
    poster.started[1] = time.time()

    def gpu_then_daemon() -> None:
        packing.done.set()
        deadline = time.monotonic() + 10
        while conn.posted != [(0,), (1,)] and time.monotonic() < deadline:
            time.sleep(0.001)
        landed.add((0,))  # the daemon lands bucket 0 only after it heard of bucket 1

    helper = threading.Timer(0.05, gpu_then_daemon)
    helper.start()
    try:
        assert poster.await_landed(landed, 0, 20.0, "test") is True
    finally:
        helper.join()
    assert conn.posted == [(0,), (1,)]
    assert 0 < poster.ready[1] - poster.started[1] < 20

    # a version ending first ends the wait (it failed: its result says why)
    landed.end()
    assert poster.await_landed(landed, 5, 20.0, "test") is False
    with pytest.raises(WeightwireError, match="never came free"):
        poster.await_landed(Landed(), 7, 0.05, "test")


def test_a_slot_waits_for_issued_copies_only_when_asked_and_for_landings_otherwise() -> None:
    # BucketsIssued frees a slot to a rank that waits on the GPU (`issued=True`), with the
    # events to wait on; a landing frees it to any rank, with nothing to wait on; a rank
    # that cannot open the events forgets them and waits for landings from then on.
    from weightwire.client.ring import Landed

    landed = Landed()
    handle = bytes(range(64))
    landed.issue((3,), (handle,))
    assert landed.poll(3, 0.01) is None  # a rank waiting for landings is not freed by it
    assert landed.poll(3, 0.01, issued=True) is True
    assert landed.events(3) == (handle,)
    landed.issue((4,), ())  # no events: nothing to wait on, so no slot freed
    assert landed.poll(4, 0.01, issued=True) is None
    landed.add((3,))
    assert landed.events(3) == ()  # landed: no wait on the GPU needed
    landed.issue((5,), (handle,))
    landed.forget_issued()
    assert landed.poll(5, 0.01, issued=True) is None and landed.events(5) == ()
    landed.end()  # a version that fails ends the wait either way
    assert landed.poll(6, 1.0, issued=True) is False
    assert landed.poll(6, 1.0) is False


def test_a_rank_asking_for_slot_events_over_tcp_waits_for_landings_bitwise(
    ring_cluster: LocalCluster,
) -> None:
    # The daemon fences a bucket's slot with CUDA IPC events only when every write of the
    # bucket is a cuda copy: over tcp it never reports BucketsIssued, and the rank reuses
    # each slot only once its bucket landed, even though it asked for events.
    job = "ring-events-tcp"
    rows = 384
    eng, dst = _engine(ring_cluster, job, rows)
    w = weights(7)[:rows].clone()
    with _trainer(ring_cluster, job, 2) as tr:
        tr.register({"w": w})
        tr.prepare()
        tr._events_on = lambda device, ring: ring.slots > 0  # type: ignore[method-assign]
        for version in (1, 2):
            w.copy_(weights(version + 7)[:rows])
            stats = tr.publish(version)
            eng.wait(version)
            assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8)), f"v{version}"
            assert stats.slot_events == 0 and stats.slot_landings == len(stats.buckets) - 2
            b = stats.buckets
            for k in range(2, len(b)):
                assert b[k].prepare_start >= b[k - 2].landed > 0, (version, k)
            status = publishing(ring_cluster, job)
            assert status["slot_events"] is True and status["buckets_issued"] == 0, status
    eng.close()


def test_slot_counters_on_host_staging_are_refused_and_the_rank_publishes_after(
    ring_cluster: LocalCluster,
) -> None:
    # GPU slot counters (`BeginVersion.fence_offset`) live at the end of GPU staging: asked
    # for with host staging, the version is refused with a typed error naming why, and
    # the same rank then publishes the version as usual, bitwise.
    job = "ring-counters-cpu"
    rows = 384
    eng, dst = _engine(ring_cluster, job, rows)
    w = weights(11)[:rows].clone()
    with _trainer(ring_cluster, job, 2) as tr:
        tr.register({"w": w})
        plan = tr.prepare()
        ring = tr.ring()
        begin = BeginVersion(
            version=1, plan_hash=plan.plan_hash, staging_buckets=2, fence_offset=ring.nbytes
        )
        with pytest.raises(WeightwireError, match="need GPU staging") as err:
            tr._conn.request(begin)
        assert err.value.code == ErrorCode.INVALID
        stats = tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8))
        assert stats.slot_counters == 0 and stats.slot_landings == len(stats.buckets) - 2
    eng.close()


def test_a_slot_on_gpu_counters_waits_only_for_packing_and_ends_with_the_version() -> None:
    # With GPU slot counters the trainer's thread waits for nothing from the daemon: only
    # for the packing of the bucket N back to complete, posting every bucket packed
    # meanwhile, in order, in one message. The version ending (failed, the daemon lost)
    # ends the wait at once even though that packing never completes (its GPU wait on a
    # counter nobody writes is released after); a wait past its time raises TimeoutError_.
    from weightwire.client.posting import Poster
    from weightwire.client.ring import Landed

    conn = _Sent()
    poster = Poster(conn, version=1)  # type: ignore[arg-type]
    landed = Landed()
    packs = [_PackEvent() for _ in range(3)]
    for b, ev in enumerate(packs):
        poster._pending.append((b, ev))  # type: ignore[arg-type]  # as post() on a GPU
        poster.started[b] = time.time()
    packs[0].done.set()
    packs[1].done.set()
    assert poster.await_posted(landed, 1, 20.0, "test") is True
    assert conn.posted == [(0, 1)]  # both in one message, bucket 2 still packing
    threading.Timer(0.05, packs[2].done.set).start()
    assert poster.drain(landed, 20.0, "test") is True
    assert conn.posted == [(0, 1), (2,)] and not poster._pending

    stuck = _PackEvent()  # its GPU waits on a counter the failed version never reaches
    poster._pending.append((3, stuck))  # type: ignore[arg-type]
    threading.Timer(0.05, landed.end).start()
    assert poster.await_posted(landed, 3, 20.0, "test") is False
    assert conn.posted == [(0, 1), (2,)]
    with pytest.raises(TimeoutError_, match="was not packed"):
        poster.await_posted(Landed(), 3, 0.05, "test")
