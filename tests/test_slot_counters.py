"""Ring-slot counters (`BeginVersion.fence_offset`): the daemon's checks (CPU), and on a
GPU the waits themselves: a packing stream held on the GPU until the daemon's stream
writes the slot's sequence number, and released by either side when a version fails
(a wait on a value nobody will write must end)."""

from __future__ import annotations

import time
from typing import Literal

import pytest
import torch

from weightwire.client.slotwait import SlotWaits, sequence
from weightwire.client.staging import FENCE_ALIGN, Staging
from weightwire.daemon.slotfence import MASK, SlotCounters
from weightwire.daemon.slotfence import sequence as daemon_sequence
from weightwire.memory.cudadrv import available
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import BeginVersion
from weightwire.protocol.plan import StagingRing
from weightwire.transport.base import LocalRegion

OK, WHY = available()
if OK and not torch.cuda.is_available():
    OK, WHY = False, "torch sees no CUDA device (a CPU build of torch?)"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")]


def ring(slots: int, slot_bytes: int = 1024, buckets: int = 6) -> StagingRing:
    if not slots:
        return StagingRing(
            slots=0, slot_bytes=0, nbytes=0, shift=(0,) * buckets, slot=(-1,) * buckets,
            reuse=(-1,) * buckets,
        )  # fmt: skip
    return StagingRing(
        slots=slots,
        slot_bytes=slot_bytes,
        nbytes=slots * slot_bytes,
        shift=(0,) * buckets,
        slot=tuple(b % slots for b in range(buckets)),
        reuse=tuple(b - slots if b >= slots else -1 for b in range(buckets)),
    )


def test_begin_version_counters_default_off() -> None:
    msg = BeginVersion(version=1, plan_hash="x")
    assert msg.fence_offset == -1 and msg.fence_base == 0


def test_sequence_numbers_agree_and_wrap() -> None:
    for base, bucket in [(0, 0), (5, 3), (MASK, 0), (MASK - 1, 7)]:
        assert sequence(base, bucket) == daemon_sequence(base, bucket)
    assert sequence(MASK, 0) == 0  # wraps: the GPU compares cyclically


@pytest.mark.parametrize(
    ("kind", "offset", "slots", "what"),
    [
        ("gpu", 2048, 0, "need a staging ring"),
        ("cpu", 2048, 2, "need GPU staging"),
        ("gpu", 1024, 2, "do not fit"),  # inside the ring's bytes
        ("gpu", 2050, 2, "do not fit"),  # not aligned
        ("gpu", 4096, 2, "do not fit"),  # past the region
    ],
)
def test_counters_that_do_not_fit_are_refused(
    kind: Literal["cpu", "gpu"], offset: int, slots: int, what: str
) -> None:
    staging = LocalRegion(id=1, kind=kind, length=4096, address=1 << 20, device=0)
    with pytest.raises(PlanError, match=what) as err:
        SlotCounters(staging, ring(slots), offset, 0, 6)
    assert err.value.code == ErrorCode.INVALID


def test_cpu_staging_has_no_counters(tmp_path: object) -> None:
    st = Staging(1000, "cpu", torch.device("cpu"), None, 0, str(tmp_path), fence_slots=4)  # type: ignore[arg-type]
    try:
        assert st.fence_slots == 0 and st.fence_offset == -1 and st.counters is None
        assert st.request().length == 1000
    finally:
        st.close()


# --- on a GPU ----------------------------------------------------------------------------


def _blocked(stream: torch.cuda.Stream, hold_s: float = 0.3) -> torch.cuda.Event:
    """An event after what `stream` has queued, checked still pending after `hold_s`."""
    ev = torch.cuda.Event()
    ev.record(stream)
    time.sleep(hold_s)
    assert not ev.query(), "the stream did not wait for the counter"
    return ev


def _done(ev: torch.cuda.Event, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
def test_gpu_pack_waits_for_the_daemons_counter(slots: int) -> None:
    """Staging with counters; the packing stream waits for slot 1's counter to reach bucket
    1's number, written by the daemon's SlotCounters (its own stream, the driver alone):
    the copy queued after the wait lands only then, bitwise."""
    dev = torch.device("cuda", 0)
    st = Staging(slots * 1024, "gpu", dev, -1, 0, fence_slots=slots)
    waits = SlotWaits()
    assert waits.usable()
    waits.base = MASK - 1  # the numbers wrap within the version: bucket 1's is 0
    assert st.counters is not None and st.fence_offset % FENCE_ALIGN == 0
    waits.fresh(st.counters)
    region = LocalRegion(
        id=1,
        kind="gpu",
        length=st.request().length,
        address=st.tensor.data_ptr(),
        device=0,
    )
    counters = SlotCounters(region, ring(slots), st.fence_offset, waits.base, 6)
    side = torch.cuda.Stream(dev)
    src = torch.arange(1024, dtype=torch.int32, device=dev).view(torch.uint8)[:1024]
    with torch.cuda.stream(side):
        waits.wait(st.counters, 1, 1)  # slot 1, after bucket 1
        st.tensor[1024:2048].copy_(src)
    ev = _blocked(side)
    counters.signal(0)  # another slot's bucket: not enough
    time.sleep(0.2)
    assert not ev.query()
    counters.signal(1)
    assert _done(ev), "the daemon's counter write did not release the wait"
    assert torch.equal(st.tensor[1024:2048].cpu(), src.cpu())
    assert int(st.counters[1].item()) & MASK == sequence(waits.base, 1)
    counters.signal(1)  # once per bucket: a second signal writes nothing
    st.close()


@pytest.mark.parametrize("side", ["trainer", "daemon"])
@pytest.mark.gpu
@pytest.mark.skipif(not OK, reason=f"no GPU here: {WHY}")
def test_gpu_failed_version_releases_every_wait(side: str) -> None:
    """A wait on a number nobody will write (the version failed; the daemon may be gone)
    ends once either side releases the counters, and later work on the stream runs."""
    dev = torch.device("cuda", 0)
    st = Staging(4 * 1024, "gpu", dev, -1, 0, fence_slots=4)
    waits = SlotWaits()
    assert waits.usable() and st.counters is not None
    waits.base = 100
    waits.fresh(st.counters)
    pack = torch.cuda.Stream(dev)
    with torch.cuda.stream(pack):
        for slot in range(4):
            waits.wait(st.counters, slot, 4 + slot)  # the version's buckets 4..7 of 8
        st.tensor.fill_(7)
    ev = _blocked(pack)
    if side == "trainer":
        waits.release(st.counters, 8)  # from a stream of its own
    else:
        region = LocalRegion(
            id=1, kind="gpu", length=st.request().length, address=st.tensor.data_ptr(), device=0
        )
        SlotCounters(region, ring(4, buckets=8), st.fence_offset, waits.base, 8).release()
    assert _done(ev), f"the {side}'s release left the packing stream waiting"
    assert bool((st.tensor == 7).all())
    waits.advance(8)
    assert waits.base == 108
    st.close()
