"""Delta sync end to end: two real daemons (own network namespaces when root) over tcp, a
trainer and an engine rank in this process. Dense, then delta versions, each checked
bitwise against the trainer's weights; and the faults of issue 17: a lost delta bucket,
a restarted engine, a destination byte changed behind weightwire's back. Each must end
in a failed version and a dense resend, never in a wrong version reported complete."""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.plan import DELTA_HEAD

from .conftest import FAST, NETNS, serve

SMALL = {"bucket-bytes": str(1 << 20), "max-write-bytes": str(256 << 10), "version-timeout-s": "4"}
_jobs = itertools.count()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **SMALL}))


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16),
        "b": (torch.randn(300, 700, generator=g) * 0.02).to(torch.bfloat16),
        "s": torch.randn(1000, generator=g),  # fp32, odd rows: several dtypes in a bucket
        "c": (torch.randn(1536, 2048, generator=g) * 0.02).to(torch.bfloat16),  # 6 MiB
    }


def step(w: dict[str, torch.Tensor], density: float, seed: int) -> None:
    """Change about `density` of every tensor's elements, in place (a sparse update)."""
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < density
        flat[mask] = (flat[mask].float() + 0.01).to(t.dtype)


def kill_and_restart(c: LocalCluster, host: int) -> None:
    """SIGKILL a host's daemon and start it again, under its name, joined once more."""
    old = c.daemons[host]
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(10)
    c.start_daemon(host, node=old.node, coordinator_endpoint=c.daemons[0].endpoint)
    c.wait_joined()


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


class Pair:
    def __init__(self, c: LocalCluster, mode: str = "auto", trainer_cls: type = Trainer) -> None:
        self.c, self.job = c, f"delta{next(_jobs)}"
        self.w = weights()
        self.dst = {n: torch.zeros_like(t) for n, t in self.w.items()}
        self.eng = self.engine()
        self.tr = trainer_cls(
            0, 1, socket=c.daemons[0].socket, job=self.job, timeout_s=30, delta=mode
        )
        self.tr.register(self.w)
        self.tr.prepare()

    def engine(self) -> Engine:
        eng = Engine(
            0, 1, socket=self.c.daemons[1].socket, job=self.job, timeout_s=30, delta_area=0.25
        )
        eng.register(self.dst)
        return eng

    def close(self) -> None:
        self.tr.close()
        self.eng.close()


@pytest.fixture
def pair(cluster: LocalCluster) -> Iterator[Pair]:
    p = Pair(cluster)
    yield p
    p.close()


def test_dense_then_delta_versions_bitwise(pair: Pair) -> None:
    total = sum(t.numel() * t.element_size() for t in pair.w.values())
    assert pair.tr.ring().slots > 0  # staging is a ring of bucket slots, smaller than the send
    first = pair.tr.publish(0)
    assert first.delta_bytes < 4096  # only trailers: nothing is held yet, all dense
    assert pair.eng.wait(0).version == 0
    assert bitwise(pair.dst, pair.w)
    for v in range(1, 4):
        step(pair.w, 0.02, v)
        stats = pair.tr.publish(v)
        pair.eng.wait(v)
        assert bitwise(pair.dst, pair.w), f"version {v} differs"
        assert 0.01 < stats.density < 0.04
        # deltas replaced the dense writes: ~2 x density of the bytes, far below dense
        assert stats.nbytes < 0.15 * total, (stats.nbytes, total)
        assert pair.eng.delta is not None and pair.eng.delta.held == v


def test_unchanged_and_all_changed_versions(pair: Pair) -> None:
    pair.tr.publish(0)
    pair.eng.wait(0)
    stats = pair.tr.publish(1)  # nothing changed: payloads of headers only
    pair.eng.wait(1)
    assert stats.density == 0 and bitwise(pair.dst, pair.w)
    for t in pair.w.values():
        t.view(torch.uint8).bitwise_not_()
    stats = pair.tr.publish(2)  # everything changed: auto goes dense
    pair.eng.wait(2)
    total = sum(t.numel() * t.element_size() for t in pair.w.values())
    assert stats.nbytes >= total and bitwise(pair.dst, pair.w)
    # not sampled (the last version went delta far inside its limits): each compare stops
    # at its limit, so the density counts what it found by then, a lower bound. The area
    # is 1/4 of the bytes; a changed byte costs 3 there, and both bytes of every element
    # changed: a compare finds at least 1/12 of the elements before it stops
    assert pair.tr.delta.sampled == 0 and stats.density > 1 / 12


def fails_checksum(pair: Pair, v: int) -> None:
    """Version v (a step on) fails at the engine with `checksum`, for both sides."""
    step(pair.w, 0.02, v)
    with pytest.raises(WeightwireError, match="checksum") as failed:
        pair.tr.publish(v)
    assert failed.value.code is ErrorCode.CHECKSUM, failed.value
    with pytest.raises(WeightwireError, match="checksum"):
        pair.eng.wait(v)


def test_byte_changed_behind_our_back(pair: Pair) -> None:
    pair.tr.publish(0)
    pair.eng.wait(0)
    pair.dst["a"].view(-1).view(torch.uint8)[12345] ^= 0x40  # not by weightwire
    fails_checksum(pair, 1)
    step(pair.w, 0.02, 2)
    stats = pair.tr.publish(2)  # the engine held nothing verified: dense again
    pair.eng.wait(2)
    assert stats.delta_bytes < 4096
    assert bitwise(pair.dst, pair.w)
    step(pair.w, 0.02, 3)
    assert pair.tr.publish(3).delta_bytes > 4096  # and deltas after that
    pair.eng.wait(3)
    assert bitwise(pair.dst, pair.w)


def test_buckets_checksummed_as_they_land(pair: Pair) -> None:
    """The engine applies and checksums each bucket once its source saw it land
    (`ApplyBucket`), not all of them after the version's last byte: over a few versions
    most ranges were checksummed early, and the versions still verify bitwise."""
    early = tail = 0
    pair.tr.publish(0)
    pair.eng.wait(0)
    rx = pair.eng.delta
    assert rx is not None
    for v in range(1, 4):
        step(pair.w, 0.02, v)
        assert pair.tr.publish(v).delta_bytes > 4096
        pair.eng.wait(v)
        assert bitwise(pair.dst, pair.w) and rx.held == v
        early, tail = early + rx.early_ranges, tail + rx.tail_ranges
    assert early > 0, (early, tail)
    assert early + tail >= 3 * 4  # every range of every version, early or at the end


def test_byte_changed_after_its_bucket_was_checked(pair: Pair) -> None:
    """A byte changed behind weightwire's back in a range whose bucket already landed and
    was checksummed, before the version's end. That version's checksum attests the bytes
    as they were when written (as it always did for a change after a version's end), so
    it completes; the change is caught by the next version, which checksums every range
    it writes (changed or not): that one fails, never completes, and the one after it is
    dense and bitwise right."""
    pair.tr.publish(0)
    pair.eng.wait(0)
    rx = pair.eng.delta
    assert rx is not None
    apply_bucket = rx.apply_bucket
    flipped: list[int] = []

    def flip_after(msg):  # type: ignore[no-untyped-def]
        apply_bucket(msg)
        rx.wait_buckets()  # applied and checksummed (host buckets may be applied beside)
        if msg.version == 1 and msg.ranges and not flipped:
            region, offset = msg.ranges[0][:2]
            rx.pieces(region, offset, 1)[0][0] ^= 0x40  # not by weightwire
            flipped.append(msg.bucket)

    rx.apply_bucket = flip_after  # type: ignore[method-assign]
    step(pair.w, 0.02, 1)
    pair.tr.publish(1)
    pair.eng.wait(1)
    assert flipped, "no bucket was applied before the version's end"
    assert not bitwise(pair.dst, pair.w)  # the change is there, checked only later
    fails_checksum(pair, 2)
    assert rx.held == -1
    step(pair.w, 0.02, 3)
    assert pair.tr.publish(3).delta_bytes < 4096  # dense: nothing verified was held
    pair.eng.wait(3)
    assert bitwise(pair.dst, pair.w)


def test_host_payloads_are_block16_where_a_bitmap_would_be_smaller(pair: Pair) -> None:
    """At 9 % of the elements changed a BITMAP body is smaller than BLOCK16 (1/8 of a byte
    per element against 2 bytes per change), but the host path sends BLOCK16 (compiled at
    both ends; BITMAP's encode and decode made such a version slower than dense)."""
    pair.tr.publish(0)
    pair.eng.wait(0)
    step(pair.w, 0.09, 1)
    stats = pair.tr.publish(1)
    pair.eng.wait(1)
    assert bitwise(pair.dst, pair.w)
    n = sum(t.numel() * t.element_size() for t in pair.w.values()) // 2  # 2-byte elements
    k = stats.density * n
    bitmap, block16 = n / 8 + 2 * k, 4 * k
    assert bitmap < block16 and stats.delta_bytes > bitmap * 1.05, (stats.delta_bytes, k)
    assert stats.delta_bytes < block16 * 1.1 + (64 << 10)


def test_a_bucket_landing_during_the_one_before_is_applied_beside_it(pair: Pair) -> None:
    """Host buckets: the next bucket that lands while one is still being applied is
    applied beside it, not after. Here the first delta bucket's apply waits (up to 20 s)
    until a later bucket of its version has been applied: applied one after the other,
    that never happens. The version completes, bitwise."""
    import threading

    pair.tr.publish(0)
    pair.eng.wait(0)
    rx = pair.eng.delta
    assert rx is not None and len(pair.tr.plan().buckets) > 1
    inner = rx._apply_bucket
    later = threading.Event()
    seen: list[tuple[int, bool]] = []

    def slow_first(early, msg):  # type: ignore[no-untyped-def]
        first = not seen
        seen.append((msg.bucket, first))
        if first:
            seen.append((-1, later.wait(20)))  # the next bucket was applied meanwhile
        inner(early, msg)
        if not first:
            later.set()

    rx._apply_bucket = slow_first  # type: ignore[method-assign]
    step(pair.w, 0.02, 1)
    pair.tr.publish(1)
    pair.eng.wait(1)
    assert (-1, True) in seen, f"the second bucket waited for the first: {seen}"
    assert bitwise(pair.dst, pair.w) and rx.held == 1


class DropsABucket(Trainer):
    """Never posts bucket `drop` of version `at`: its (delta) writes are lost."""

    drop, at = 1, -1

    def _post_bucket(self, poster, index, device, started, delta, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (poster.version, index) == (self.at, self.drop):
            assert delta, "the dropped bucket should have been a delta"
            return
        super()._post_bucket(poster, index, device, started, delta, *args, **kwargs)


def test_lost_delta_bucket(cluster: LocalCluster) -> None:
    p = Pair(cluster, trainer_cls=DropsABucket)
    try:
        p.tr.publish(0)
        p.eng.wait(0)
        step(p.w, 0.02, 1)
        p.tr.at = 1  # type: ignore[attr-defined]
        with pytest.raises(WeightwireError):
            p.tr.publish(1)
        with pytest.raises(WeightwireError):
            p.eng.wait(1)
        step(p.w, 0.02, 2)
        stats = p.tr.publish(2)
        p.eng.wait(2)
        assert stats.delta_bytes < 4096  # dense resend
        assert bitwise(p.dst, p.w)
    finally:
        p.close()


def test_restarted_engine_gets_dense(pair: Pair) -> None:
    pair.tr.publish(0)
    pair.eng.wait(0)
    step(pair.w, 0.02, 1)
    pair.tr.publish(1)
    pair.eng.wait(1)
    pair.eng.close()  # the engine goes away; a new one starts from zeros
    for t in pair.dst.values():
        t.zero_()
    pair.dst = {n: torch.zeros_like(t) for n, t in pair.w.items()}
    pair.eng = pair.engine()
    step(pair.w, 0.02, 2)
    for attempt in range(20):  # the replan reaches the trainer as PLAN_CHANGED or a failure
        try:
            stats = pair.tr.publish(2 + attempt)
            break
        except WeightwireError:
            continue
    else:
        raise AssertionError("never published to the new engine")
    v = 2 + attempt
    pair.eng.wait(v)
    assert stats.delta_bytes < 4096  # dense: the new engine holds nothing
    assert bitwise(pair.dst, pair.w)


class GarblesAPayload(Trainer):
    """Flips one byte of the first delta payload of version `at` after it was encoded and
    before it is sent (bytes lost or garbled on their way: the transport and the counts
    all say fine)."""

    at = -1
    where = "value"  # "head": the payload's header, so that it does not even decode;
    # "block": where it writes (a range of its sender's, or none)

    def _post_bucket(self, poster, index, device, started, delta, *args, **kwargs):  # type: ignore[no-untyped-def]
        if poster.version == self.at and delta:
            _, slot, nbytes = delta[0]
            ds = self.plan().buckets[index].deltas[slot]
            out = self._stage.delta_out
            assert out is not None
            at = (
                ds.src_offset
                + {"value": nbytes - 1, "head": 8, "block": DELTA_HEAD + 9}[self.where]
            )  # "block": its first block's destination offset, 4 KiB off
            out.tensor[at] ^= 0x10
            self.at = -1
        super()._post_bucket(poster, index, device, started, delta, *args, **kwargs)


@pytest.mark.parametrize("where", ["value", "head", "block"])
def test_garbled_payload_fails_never_completes(cluster: LocalCluster, where: str) -> None:
    p = Pair(cluster, trainer_cls=GarblesAPayload)
    p.tr.where = where  # type: ignore[attr-defined]
    try:
        p.tr.publish(0)
        p.eng.wait(0)
        step(p.w, 0.02, 1)
        p.tr.at = 1  # type: ignore[attr-defined]
        with pytest.raises(WeightwireError, match="checksum") as failed:
            p.tr.publish(1)
        assert failed.value.code is ErrorCode.CHECKSUM, failed.value
        with pytest.raises(WeightwireError, match="checksum"):
            p.eng.wait(1)
        assert p.eng.delta is not None and p.eng.delta.held == -1
        step(p.w, 0.02, 2)
        stats = p.tr.publish(2)  # dense: the engine holds no verified version
        p.eng.wait(2)
        assert stats.delta_bytes < 4096
        assert bitwise(p.dst, p.w)
        step(p.w, 0.02, 3)
        assert p.tr.publish(3).delta_bytes > 4096
        p.eng.wait(3)
        assert bitwise(p.dst, p.w)
    finally:
        p.close()


def test_restarted_engine_daemon_gets_dense() -> None:
    """The engine's daemon restarts (the engine process and its bytes stay): the engine
    registers again holding no verified version, the plan is made anew, and the next
    version that lands is dense, then deltas again."""
    c = LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **SMALL})
    c.start()
    try:
        c.wait_joined()
        p = Pair(c)
        try:
            p.tr.publish(0)
            p.eng.wait(0)
            step(p.w, 0.02, 1)
            assert p.tr.publish(1).delta_bytes > 4096
            p.eng.wait(1)
            kill_and_restart(c, 1)
            step(p.w, 0.02, 2)
            for attempt in range(40):  # until the engine re-registered and the plan is new
                try:
                    stats = p.tr.publish(2 + attempt)
                    break
                except WeightwireError:
                    time.sleep(0.25)
            else:
                raise AssertionError("never published to the engine after its daemon restarted")
            v = 2 + attempt
            p.eng.wait(v)
            assert stats.delta_bytes < 4096  # dense: nothing is known about its bytes
            assert bitwise(p.dst, p.w)
            step(p.w, 0.02, 99)
            assert p.tr.publish(v + 1).delta_bytes > 4096
            p.eng.wait(v + 1)
            assert bitwise(p.dst, p.w)
        finally:
            p.close()
    finally:
        c.stop()


def test_sampling_skipped_only_after_a_delta_well_inside_its_limit(pair: Pair) -> None:
    """A slot whose last payload went delta far from its limit is compared without the
    sampling pass first (a dense version in between, `off`, changes nothing); one that
    went dense or came close is sampled. A wrong guess (a version that changed
    everything after a sparse one) stops at the limit and goes dense: bitwise either
    way."""
    total = sum(t.numel() * t.element_size() for t in pair.w.values())
    pair.tr.publish(0)
    pair.eng.wait(0)
    sent: list[tuple[int, float, int]] = []
    steps = (0.02, 0.02, "off", 0.02, 1.0, 0.02, 0.12, 0.02)
    for v, density in enumerate(steps, start=1):
        pair.tr.delta.mode = "off" if density == "off" else "auto"
        if density == 1.0:  # new weights: every element changes
            for n, t in weights(seed=v).items():
                pair.w[n].copy_(t)
        else:
            step(pair.w, 0.02 if density == "off" else float(density), v)
        stats = pair.tr.publish(v)
        pair.eng.wait(v)
        assert bitwise(pair.dst, pair.w), f"version {v} differs"
        sent.append((pair.tr.delta.sampled, stats.nbytes / total, len(pair.tr.delta.host.fill)))
    slots = sent[0][2]
    assert slots > 1  # several delta slots, each went delta
    s1, s2, off, s4, s5, s6, s7, s8 = sent
    assert s1[0] == slots  # nothing known yet: every slot sampled
    assert s2[0] == 0 and s2[1] < 0.15  # sparse after sparse: none sampled, still delta
    assert off[0] == 0 and off[1] > 0.99 and off[2] == slots  # dense: nothing compared
    assert s4[0] == 0 and s4[1] < 0.15  # what the last compare found still holds
    assert s5[0] == 0 and s5[1] > 0.99 and s5[2] == 0  # the wrong guess: all went dense
    assert s6[0] == slots and s6[1] < 0.15  # after dense: sampled again
    assert s7[0] == 0 and s7[1] < 0.5  # 12 %: fits, but more than half of what fits
    assert s8[0] == slots  # came close: sampled


def flip(w: dict[str, torch.Tensor], bits: int, density: float, seed: int) -> int:
    """XOR `bits` into about `density` of every bf16 tensor's elements; how many."""
    g = torch.Generator().manual_seed(seed)
    changed = 0
    for t in w.values():
        if t.dtype == torch.bfloat16:
            flat = t.view(-1).view(torch.int16)
            mask = torch.rand(flat.numel(), generator=g) < density
            flat[mask] ^= bits
            changed += int(mask.sum())
    return changed


def test_host_deltas_are_bytes_for_small_steps_and_elements_for_large(pair: Pair) -> None:
    """A bf16 element that moved an ULP changed its low byte only: it costs 3 bytes on the
    wire (2 of position, 1 of value), not 4. One that changed both bytes costs 6 as bytes,
    4 as an element. Each compare counts what the other unit would have cost, and the
    bucket's next compare uses the cheaper. The density counts elements, exactly."""
    pair.tr.publish(0)
    pair.eng.wait(0)
    elements = sum(t.numel() * t.element_size() for t in pair.w.values()) // 2
    per_change = []
    for v, bits in enumerate((0x0001, 0x0101, 0x0101, 0x0001, 0x0001), start=1):
        k = flip(pair.w, bits, 0.03, v)
        stats = pair.tr.publish(v)
        pair.eng.wait(v)
        assert bitwise(pair.dst, pair.w), f"version {v} differs"
        assert stats.density == pytest.approx(k / elements, abs=1e-12)
        per_change.append(stats.delta_bytes / k)
    low, both_as_bytes, both, low_as_elements, low_again = per_change
    assert 3 <= low < 3.1 and 3 <= low_again < 3.1  # bytes
    assert 6 <= both_as_bytes < 6.1  # bytes: the last compare said they cost less
    assert 4 <= both < 4.1 and 4 <= low_as_elements < 4.1  # elements, after that
