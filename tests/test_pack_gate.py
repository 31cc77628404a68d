"""A trainer's pack counter (`BeginVersion.gate_offset`): buckets posted as soon as their
packing is queued, the daemon's copies waiting on the GPU for it. Checked here: the
message, where the counter may be, staging's layout, and on a GPU a trainer killed while
the daemon's copies wait for packing that will never run (the daemon must not wait
forever). Bitwise transfers through it: tests/test_gpu_e2e.py (`gated`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Literal

import msgspec
import pytest
import torch

from weightwire.client import Engine, Trainer, VersionInfo
from weightwire.client.staging import FENCE_ALIGN, Staging
from weightwire.daemon.packgate import PackGate
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory.cudadrv import available
from weightwire.protocol.errors import ErrorCode, PlanError, WeightwireError
from weightwire.protocol.local import BeginVersion, LocalMessage
from weightwire.transport.base import LocalRegion

from .conftest import FAST
from .test_slot_counters import ring

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"


def test_begin_version_gate_default_off_and_round_trips() -> None:
    assert BeginVersion(version=1, plan_hash="x").gate_offset == -1
    msg = BeginVersion(version=1, plan_hash="x", fence_offset=2048, gate_offset=2056)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=LocalMessage)
    assert back == msg


@pytest.mark.parametrize(
    ("kind", "offset", "what"),
    [
        ("cpu", 2048, "needs GPU staging"),
        ("gpu", 1024, "does not fit"),  # inside the ring's bytes
        ("gpu", 2050, "does not fit"),  # not aligned
        ("gpu", 4096, "does not fit"),  # past the region
        ("gpu", 2052, "does not fit"),  # on the second slot counter
    ],
)
def test_pack_counter_that_does_not_fit_is_refused(
    kind: Literal["cpu", "gpu"], offset: int, what: str
) -> None:
    """Refused with INVALID naming what is wrong, before any CUDA is touched."""
    staging = LocalRegion(id=1, kind=kind, length=4096, address=1 << 20, device=0)
    with pytest.raises(PlanError, match=what) as err:
        PackGate(staging, ring(2), offset, 0, 6, fence=(2048, 2))
    assert err.value.code == ErrorCode.INVALID


def test_cpu_staging_has_no_pack_counter(tmp_path: object) -> None:
    st = Staging(1000, "cpu", torch.device("cpu"), None, 0, str(tmp_path), fence_slots=2, gate=True)  # type: ignore[arg-type]
    try:
        assert not st.gate and st.gate_offset == -1 and st.gate_word is None
        assert st.request().length == 1000
    finally:
        st.close()


@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
@pytest.mark.parametrize("slots", [0, 3])
def test_gpu_staging_layout_with_a_pack_counter(slots: int) -> None:
    """The slot counters, then the pack counter, past the ring's bytes: all registered,
    all starting at the sequence base (no bucket's number reached)."""
    st = Staging(5000, "gpu", torch.device("cuda", 0), -1, 0, fence_slots=slots, gate=True)
    first = -(-5000 // FENCE_ALIGN) * FENCE_ALIGN
    assert st.fence_offset == first and st.gate_offset == first + 4 * slots
    assert st.length == st.gate_offset + 4 == st.request().length
    assert st.gate_word is not None and st.gate_word.numel() == 1
    assert st.gate_word.data_ptr() == st.tensor.data_ptr() + st.gate_offset
    assert (st.counters is None) == (slots == 0)
    assert st.tensor.numel() == 5000


# --- a trainer killed mid-version, on a GPU -------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from weightwire.client import Trainer

    sock, job = sys.argv[1:3]
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    tr = Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=2)
    tr.register({"w": w})
    tr.prepare(60)
    tr.publish(1)
    print("published 1", flush=True)
    waits, post = tr._slots, tr._post_bucket
    stuck = {}

    def wait(counters, slot, bucket):  # the version's last number: nothing ends this wait
        stuck.setdefault("bucket", bucket + tr.ring().slots)
        waits.wait = original
        original(counters, slot, len(tr.plan().buckets) - 1)

    def post_then_die(poster, index, *args, **kwargs):
        post(poster, index, *args, **kwargs)
        if index == stuck.get("bucket"):  # posted: the daemon queues copies gated on it
            print("posted", index, flush=True)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

    original, waits.wait = waits.wait, wait
    tr._post_bucket = post_then_die
    w.mul_(-1)
    tr.publish(2)
    print("not killed", flush=True)
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=1, extra={**FAST, "bucket-bytes": str(256 << 10), "cuda": "on"})
    c.start()
    c.wait_joined()
    yield c
    assert c.stop() == [0], f"logs in {c.workdir}"


@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
def test_gpu_trainer_killed_while_copies_wait_for_its_packing(cluster: LocalCluster) -> None:
    """A trainer (its own process) posts a bucket whose packing waits forever on the GPU
    (a slot counter at a number never written), so the daemon's copies of it wait on the
    pack counter, and is killed (SIGKILL). The daemon fails the version once the session
    is gone and releases the pack counter: the engine learns version 2 failed, and the same
    daemon's cuda lane (the same GPU pair) then carries another trainer's versions,
    bitwise: nothing waits forever."""
    sock = cluster.daemons[0].socket
    job = "gate-killed"
    got = {"w": torch.zeros(1 << 20, dtype=torch.float32, device="cuda:0")}
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=60)
    eng.register(got)
    events: list[VersionInfo | Exception] = []
    told = threading.Condition()

    def on_version(event: VersionInfo | Exception) -> None:
        with told:
            events.append(event)
            told.notify_all()

    eng.on_version(on_version)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, sock, job],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert "published 1" in out and "posted" in out, out
    assert "not killed" not in out and child.returncode == -9, out
    with told:  # version 2 fails once the session times out (3 s), not hung
        assert told.wait_for(lambda: len(events) >= 2, 60), events
    first, second = events[:2]
    assert isinstance(first, VersionInfo) and first.version == 1, events
    assert isinstance(second, WeightwireError) and "version 2" in second.message, events
    eng.close()

    # the lane from this GPU to itself is free: another job's versions land bitwise
    w = torch.randn(1 << 20, device="cuda:0")
    dst = {"w": torch.zeros_like(w)}
    e2 = Engine(0, 1, socket=sock, job="gate-after", timeout_s=60)
    e2.register(dst)
    tr = Trainer(0, 1, socket=sock, job="gate-after", timeout_s=60, staging_buckets=2)
    tr.register({"w": w})
    try:
        for version in (1, 2):
            w.mul_(-1)
            stats = tr.publish(version)
            e2.wait(version, 60)
            assert stats.gated and stats.slot_counters > 0, stats
            assert torch.equal(dst["w"].view(torch.uint8), w.view(torch.uint8))
    finally:
        tr.close()
        e2.close()


def test_fast_switching_is_counted_across_threads() -> None:
    """Publishes on several threads lower the GIL switch interval together and restore it,
    as found, once the last one ends (in any order)."""
    import sys
    import threading

    from weightwire.client.gilswitch import SWITCH_S, fast_switching

    before = sys.getswitchinterval()
    first, second = fast_switching(), fast_switching()
    first.__enter__()
    assert sys.getswitchinterval() <= SWITCH_S
    done = threading.Event()

    def other() -> None:
        second.__enter__()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert done.is_set()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() <= SWITCH_S  # the other publish is still on
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
    with fast_switching(False):
        assert sys.getswitchinterval() == before


@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
@pytest.mark.parametrize("gate_copies", [False, True])
def test_gpu_publish_switches_fast_from_its_begin(cluster: LocalCluster, gate_copies: bool) -> None:
    """A GPU publish, gated or not, runs at the short GIL switch interval from its
    BeginVersion request on (the request is watched where the trainer makes it, not
    replaced), and the interval is as found after it, also when the publish fails."""
    import sys

    from weightwire.client.gilswitch import SWITCH_S

    sock = cluster.daemons[0].socket
    job = f"gil-{gate_copies}"
    w = torch.randn(1 << 18, device="cuda:0")
    dst = {"w": torch.zeros_like(w)}
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=60)
    eng.register(dst)
    tr = Trainer(0, 1, socket=sock, job=job, timeout_s=60, gate_copies=gate_copies)
    tr.register({"w": w})
    seen: list[float] = []
    request = tr._conn.request

    def watched(msg: object, *args: object, **kwargs: object) -> object:
        if isinstance(msg, BeginVersion):
            seen.append(sys.getswitchinterval())
        return request(msg, *args, **kwargs)  # type: ignore[arg-type]

    tr._conn.request = watched  # type: ignore[method-assign]
    before = sys.getswitchinterval()
    try:
        stats = tr.publish(1)
        eng.wait(1, 60)
        assert torch.equal(dst["w"].view(torch.uint8), w.view(torch.uint8))
        assert stats.gated == gate_copies, stats
        assert seen and seen[-1] <= SWITCH_S < before, (seen, before)
        assert sys.getswitchinterval() == before
        with pytest.raises(WeightwireError):  # a version not above the last one is refused
            tr.publish(1)
        assert sys.getswitchinterval() == before
    finally:
        tr.close()
        eng.close()
