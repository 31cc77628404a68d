"""The flow-level simulator: analytic cases, a plain event-by-event reference, its error."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from weightwire.plan.simulate import maxmin_rates, simulate

GB = 1e9


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


# --- max-min fair rates ----------------------------------------------------------------


def plain_maxmin(flows: list[tuple[int, int]], cap: list[float]) -> list[float]:
    """Progressive filling, one small step of thought at a time."""
    rate = [0.0] * len(flows)
    frozen = [False] * len(flows)
    left = list(cap)
    while not all(frozen):
        users: dict[int, list[int]] = {}
        for i, (a, b) in enumerate(flows):
            if not frozen[i]:
                users.setdefault(a, []).append(i)
                users.setdefault(b, []).append(i)
        level = min(left[r] / len(us) for r, us in users.items())
        full = [r for r, us in users.items() if left[r] / len(us) <= level * (1 + 1e-12)]
        for r in full:
            for i in users[r]:
                if not frozen[i]:
                    frozen[i] = True
                    rate[i] = level
                    a, b = flows[i]
                    left[a] -= level
                    left[b] -= level
        for r in full:
            left[r] = 0.0
    return rate


def test_maxmin_two_levels() -> None:
    # NICs: 0, 1 sources; 2, 3 destinations. Source 0 (rate 1) feeds 2 and 3; source 1
    # (rate 10) feeds 3 (rate 2). Source 0 saturates first at 1/2 per flow; 3 has 1.5 left.
    rates = maxmin_rates([0, 0, 1], [2, 3, 3], [1.0, 10.0, 10.0, 2.0])
    assert list(rates) == [0.5, 0.5, 1.5]


def test_maxmin_random_against_plain() -> None:
    rng = random.Random(4)
    for _ in range(200):
        ns, nd = rng.randint(1, 6), rng.randint(1, 6)
        cap = [rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 5)]) for _ in range(ns + nd)]
        pairs = sorted(
            {(rng.randrange(ns), ns + rng.randrange(nd)) for _ in range(rng.randint(1, 12))}
        )
        got = maxmin_rates([a for a, _ in pairs], [b for _, b in pairs], cap)
        want = plain_maxmin(pairs, cap)
        assert np.allclose(got, want, rtol=1e-9), (pairs, cap, got, want)
        load = np.zeros(ns + nd)
        for (a, b), r in zip(pairs, got, strict=True):
            load[a] += r
            load[b] += r
        assert (load <= np.array(cap) * (1 + 1e-9)).all()


# --- analytic transfer times -------------------------------------------------------------


def test_one_flow() -> None:
    r = simulate([0], [0], [10 * GB], [0], [50 * GB], [25 * GB])
    assert close(r.seconds, 10 / 25)


def test_fan_out_is_source_bound() -> None:
    n = 8
    r = simulate([0] * n, list(range(n)), [GB] * n, [0] * n, [50 * GB], [50 * GB] * n)
    assert close(r.seconds, n / 50)


def test_incast_is_destination_bound() -> None:
    n = 8
    r = simulate(list(range(n)), [0] * n, [GB] * n, [0] * n, [50 * GB] * n, [50 * GB])
    assert close(r.seconds, n / 50)
    assert np.allclose(r.src_finish, n / 50)


def test_unequal_flows_share_then_speed_up() -> None:
    # two flows on one destination link of rate C: a finishes at 2a/C, b at (a + b)/C
    a, b, c = 2 * GB, 5 * GB, 10 * GB
    r = simulate([0, 1], [0, 0], [a, b], [0, 0], [100 * GB, 100 * GB], [c])
    assert close(float(r.src_finish[0]), 2 * a / c)
    assert close(r.seconds, (a + b) / c)


def test_all_to_all_balanced_meets_the_bound() -> None:
    ns, nd = 6, 4
    src = [s for s in range(ns) for d in range(nd)]
    dst = [d for s in range(ns) for d in range(nd)]
    r = simulate(src, dst, [GB] * (ns * nd), [0] * (ns * nd), [10 * GB] * ns, [10 * GB] * nd)
    bound = max(ns * GB / (10 * GB), nd * GB / (10 * GB))
    assert close(r.seconds, bound)


@pytest.mark.parametrize("per_bucket_s", [1e-3, 0.05])
def test_bucket_overheads(per_bucket_s: float) -> None:
    # one pair, 3 buckets of B bytes, posted at h, 2h, 3h; the link drains B in B/C
    size, rate, h = 1 * GB, 10 * GB, per_bucket_s
    r = simulate([0] * 3, [0] * 3, [size] * 3, [0, 1, 2], [rate], [rate], bucket_overhead_s=h)
    if size / rate >= h:  # the link never idles after the first post
        assert close(r.seconds, h + 3 * size / rate)
    else:  # each bucket is done before the next is posted
        assert close(r.seconds, 3 * h + size / rate)


def test_pack_rate_paces_the_posts() -> None:
    # packing at 5 GB/s feeds a 10 GB/s link: buckets are posted at 0.2, 0.4 and 0.6 s,
    # and each drains in 0.1 s
    r = simulate([0] * 3, [0] * 3, [GB] * 3, [0, 1, 2], [10 * GB], [10 * GB], pack_rate=5 * GB)
    assert close(r.seconds, 0.7)


def test_packed_bytes_differ_from_sent() -> None:
    # a bucket packed once and sent to 4 destinations: packing costs its bytes once
    r = simulate(
        [0] * 4,
        [0, 1, 2, 3],
        [GB] * 4,
        [0] * 4,
        [100 * GB],
        [10 * GB] * 4,
        packed_bytes={(0, 0): GB},
        pack_rate=10 * GB,
    )
    assert close(r.seconds, 0.1 + 0.1)


def test_write_overhead() -> None:
    r = simulate([0], [0], [GB], [0], [10 * GB], [10 * GB], writes=[100], write_overhead_s=1e-4)
    assert close(r.seconds, 0.1 + 100 * 1e-4)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        simulate([0], [3], [1.0], [0], [1.0], [1.0])
    with pytest.raises(ValueError):
        simulate([0], [0], [1.0], [0], [0.0], [1.0])


def test_empty() -> None:
    r = simulate([], [], [], [], [1.0], [1.0])
    assert r.seconds == 0.0 and r.pairs == 0


# --- a plain reference: one event at a time, flows in plain Python ------------------------


def plain_simulate(
    flows: list[tuple[int, int, float, int]],
    ns: int,
    nd: int,
    s_rate: list[float],
    d_rate: list[float],
    overhead: float,
) -> float:
    """Exact fluid schedule. A flow (s, d, bytes, bucket) may move once its bucket is posted
    (at (k + 1) x overhead for the source's k-th non-empty bucket) and every earlier
    flow of the same pair has finished."""
    buckets = {s: sorted({b for fs, _, _, b in flows if fs == s}) for s in range(ns)}
    post = {(s, b): (k + 1) * overhead for s, bs in buckets.items() for k, b in enumerate(bs)}
    merged: dict[tuple[int, int, int], float] = {}
    for s, d, v, b in flows:
        merged[(s, d, b)] = merged.get((s, d, b), 0.0) + v
    left = dict(merged)
    cap = list(s_rate) + list(d_rate)
    t, last = 0.0, 0.0
    while left:
        heads: dict[tuple[int, int], tuple[int, int, int]] = {}
        for key in sorted(left, key=lambda k: k[2]):
            if (key[0], key[1]) not in heads:
                heads[(key[0], key[1])] = key
        moving = [k for k in heads.values() if post[(k[0], k[2])] <= t + 1e-15]
        rates = plain_maxmin([(k[0], ns + k[1]) for k in moving], cap) if moving else []
        nxt = min(
            [post[(k[0], k[2])] for k in heads.values() if post[(k[0], k[2])] > t] + [math.inf]
        )
        for k, r in zip(moving, rates, strict=True):
            nxt = min(nxt, t + left[k] / r)
        for k, r in zip(moving, rates, strict=True):
            left[k] -= r * (nxt - t)
            if left[k] <= 1e-9 * merged[k]:
                del left[k]
                last = nxt
        t = nxt
    return last


def random_case(
    seed: int,
) -> tuple[list[tuple[int, int, float, int]], int, int, list[float], list[float]]:
    rng = random.Random(seed)
    ns, nd = rng.randint(1, 5), rng.randint(1, 5)
    flows = [
        (rng.randrange(ns), rng.randrange(nd), rng.uniform(0.1, 3) * GB, rng.randrange(4))
        for _ in range(rng.randint(1, 25))
    ]
    s_rate = [rng.choice([10.0, 25.0, 50.0]) * GB for _ in range(ns)]
    d_rate = [rng.choice([10.0, 25.0, 50.0]) * GB for _ in range(nd)]
    return flows, ns, nd, s_rate, d_rate


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("overhead", [0.0, 0.02])
def test_exact_mode_matches_plain_reference(seed: int, overhead: float) -> None:
    flows, ns, nd, s_rate, d_rate = random_case(seed)
    src, dst, v, b = (list(x) for x in zip(*flows, strict=True))
    got = simulate(src, dst, v, b, s_rate, d_rate, bucket_overhead_s=overhead, rel_tol=0.0)
    want = plain_simulate(flows, ns, nd, s_rate, d_rate, overhead)
    assert math.isclose(got.seconds, want, rel_tol=1e-9), (got.seconds, want)


@pytest.mark.parametrize("seed", range(20))
def test_windowed_mode_is_a_tight_upper_bound(seed: int) -> None:
    flows, _, _, s_rate, d_rate = random_case(100 + seed)
    src, dst, v, b = (list(x) for x in zip(*flows, strict=True))
    exact = simulate(src, dst, v, b, s_rate, d_rate, bucket_overhead_s=0.01, rel_tol=0.0).seconds
    for tol in (1e-2, 1e-3, 1e-4):
        approx = simulate(src, dst, v, b, s_rate, d_rate, bucket_overhead_s=0.01, rel_tol=tol)
        assert exact * (1 - 1e-12) <= approx.seconds <= exact * (1 + 3 * tol)


def kimi_like(seed: int, ns: int, nd: int, nb: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    s, d, b = np.meshgrid(np.arange(ns), np.arange(nd), np.arange(nb), indexing="ij")
    v = rng.uniform(0.5, 1.5, s.size) * 64 * GB / (ns * nb)
    return s.ravel(), d.ravel(), v, b.ravel()


def test_accuracy_at_scale_against_exact_mode() -> None:
    """The default window against the exact fluid answer, at a size exact mode can afford
    (64 x 32 NICs, 4 buckets: 8192 flows), and both against the busiest-NIC floor."""
    s, d, v, b = kimi_like(1, 64, 32, 4)
    rate = 50 * GB
    exact = simulate(s, d, v, b, [rate] * 64, [rate] * 32, bucket_overhead_s=50e-6, rel_tol=0)
    default = simulate(s, d, v, b, [rate] * 64, [rate] * 32, bucket_overhead_s=50e-6)
    floor = max(default.dst_bytes.max(), default.src_bytes.max()) / rate
    print(
        f"\nfloor {floor:.6f} s  exact {exact.seconds:.6f} s ({exact.steps} steps)  "
        f"default {default.seconds:.6f} s ({default.steps} steps)  "
        f"error {default.seconds / exact.seconds - 1:.2e}"
    )
    assert exact.seconds >= floor
    assert exact.seconds <= default.seconds <= exact.seconds * (1 + 3e-4)


@pytest.mark.slow
def test_kimi_scale_runs_fast() -> None:
    s, d, v, b = kimi_like(0, 256, 128, 16)  # 524,288 flows
    t0 = time.perf_counter()
    r = simulate(s, d, v, b, [50 * GB] * 256, [50 * GB] * 128, bucket_overhead_s=50e-6)
    took = time.perf_counter() - t0
    floor = r.dst_bytes.max() / (50 * GB)
    print(
        f"\n256x128x16: {took:.1f} s wall, {r.steps} steps, {r.seconds:.5f} s vs floor {floor:.5f}"
    )
    assert took < 60
    assert floor <= r.seconds <= floor * 1.001 + 50e-6
