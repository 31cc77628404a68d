"""A flow-level simulation of one weight-sync version on a cluster of NICs.

Model:

- Every GPU has one NIC of a given rate, shared by everything it sends (trainer side) or
  receives (engine side).
- A *flow* is the bytes one source sends to one destination in one of the source's
  buckets (all its writes there, aggregated).
- Source s packs its buckets in order; bucket b is posted (its flows start) at
  `sum over b' <= b of (bucket_overhead_s + packed_bytes[s, b'] / pack_rate)`. Packing
  runs ahead of the transfer (the staging region holds the whole version), so posting
  never waits for earlier buckets to land.
- Flows between the same pair of NICs go in order (one reliable connection per pair is
  a FIFO): a pair's later bucket queues behind its earlier one. So at any time a pair is
  one fluid flow whose backlog is what it has been posted and not yet delivered.
- Active pairs share bandwidth max-min fairly: progressive filling (water-filling) over
  all source and destination NICs at once.
- Each write may cost a fixed time on its NIC (`write_overhead_s`), charged as that many
  seconds of the source NIC's line rate added to the flow's bytes.

The simulation is event driven: rates are constant between events (a pair drains, a
bucket is posted). Events closer together than `rel_tol` x (current time) are taken
together, which only ever delays a pair (a freed share is handed out at the end of the
window, a posted bucket starts at its end): the result is an upper bound of the exact
fluid schedule, within about `rel_tol` of it (see `tests/test_simulate.py`).
`rel_tol=0` gives the exact fluid answer, one event at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SimResult:
    seconds: float  # the last byte lands
    src_finish: FloatArray  # per source NIC: when its last byte has gone (0: it sends none)
    dst_finish: FloatArray  # per destination NIC: when its last byte has landed
    src_bytes: FloatArray  # payload bytes per NIC (overheads not counted)
    dst_bytes: FloatArray
    pairs: int  # (source, destination) pairs that carry bytes
    flows: int  # (source, destination, bucket) flows
    steps: int  # rate computations
    # with `land=True`: per (source, destination, bucket) flow, when its last byte landed
    flow_src: IntArray | None = None
    flow_dst: IntArray | None = None
    flow_bucket: IntArray | None = None
    flow_land: FloatArray | None = None


class Fabric:
    """Flows each crossing two resources (a source and a destination NIC), indexed once so
    that max-min fair rates of any subset of them cost little more than the subset."""

    def __init__(self, a: IntArray, b: IntArray, cap: FloatArray) -> None:
        self.a = np.asarray(a, dtype=np.int64)
        self.b = np.asarray(b, dtype=np.int64)
        self.cap = np.asarray(cap, dtype=np.float64)
        self.nres = self.cap.shape[0]
        n = self.a.shape[0]
        ends = np.concatenate([self.a, self.b])
        order = np.argsort(ends, kind="stable")
        self.flows_of = np.concatenate([np.arange(n), np.arange(n)])[order]
        self.start = np.searchsorted(ends[order], np.arange(self.nres + 1))

    def rates(self, active: npt.NDArray[np.bool_], eps: float = 1e-12) -> tuple[FloatArray, int]:
        """Max-min fair rates of the `active` flows (0 for the others), and the rounds.

        Progressive filling: every unfrozen flow gets the same level; the resource with
        the least capacity left per unfrozen flow saturates first, and its flows freeze
        at that level.
        """
        nres = self.nres
        rates = np.zeros(self.a.shape[0])
        frozen = ~active
        cnt = np.bincount(self.a[active], minlength=nres) + np.bincount(
            self.b[active], minlength=nres
        )
        rem = self.cap.copy()
        rounds = 0
        while True:
            live = cnt > 0
            if not live.any():
                break
            rounds += 1
            share = np.full(nres, np.inf)
            share[live] = rem[live] / cnt[live]
            level = float(share.min())
            sat = np.flatnonzero(share <= level * (1 + eps))
            lo, hi = self.start[sat], self.start[sat + 1]
            if sat.shape[0] == 1:
                seg = self.flows_of[lo[0] : hi[0]]
            else:  # the flows of every saturated resource at once, each once: a flow
                n = hi - lo  # whose both ends saturate is taken from its first end
                at = np.arange(int(n.sum())) + np.repeat(lo - np.cumsum(n) + n, n)
                seg = self.flows_of[at]
                saturated = np.zeros(nres, dtype=bool)
                saturated[sat] = True
                first_end = self.a[seg]
                seg = seg[(np.repeat(sat, n) == first_end) | ~saturated[first_end]]
            newly = seg[~frozen[seg]]
            frozen[newly] = True
            rates[newly] = level
            gone = np.bincount(self.a[newly], minlength=nres) + np.bincount(
                self.b[newly], minlength=nres
            )
            cnt -= gone
            rem -= level * gone
            rem[sat] = 0.0
            np.maximum(rem, 0.0, out=rem)
        return rates, rounds


def maxmin_rates(a: npt.ArrayLike, b: npt.ArrayLike, cap: npt.ArrayLike) -> FloatArray:
    """Max-min fair rates of flows each crossing resources `a[i]` and `b[i]` (of `cap`)."""
    a_arr = np.asarray(a, dtype=np.int64)
    fabric = Fabric(a_arr, np.asarray(b, dtype=np.int64), np.asarray(cap, dtype=np.float64))
    return fabric.rates(np.ones(a_arr.shape[0], dtype=bool))[0]


def simulate(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    nbytes: npt.ArrayLike,
    bucket: npt.ArrayLike,
    src_rate: npt.ArrayLike,
    dst_rate: npt.ArrayLike,
    *,
    packed_bytes: dict[tuple[int, int], float] | None = None,
    pack_rate: float = float("inf"),
    bucket_overhead_s: float = 0.0,
    writes: npt.ArrayLike | None = None,
    write_overhead_s: float = 0.0,
    rel_tol: float = 1e-4,
    land: bool = False,
) -> SimResult:
    """Simulate flows `i`: `nbytes[i]` from source NIC `src[i]` to destination NIC
    `dst[i]`, posted with bucket `bucket[i]` of its source. Rates in bytes per second.

    `packed_bytes[(s, b)]`: bytes source s packs for bucket b (default: the bytes it sends
    in it), which take `packed / pack_rate` seconds to pack. `writes[i]`: writes in flow i.
    `land`: also when each (source, destination, bucket) flow's last byte landed (a
    pair drains its flows in the order they were posted).
    """
    s_arr = np.asarray(src, dtype=np.int64)
    d_arr = np.asarray(dst, dtype=np.int64)
    v_arr = np.asarray(nbytes, dtype=np.float64)
    b_arr = np.asarray(bucket, dtype=np.int64)
    s_rate = np.asarray(src_rate, dtype=np.float64)
    d_rate = np.asarray(dst_rate, dtype=np.float64)
    ns, nd = s_rate.shape[0], d_rate.shape[0]
    if not (s_arr.shape == d_arr.shape == v_arr.shape == b_arr.shape):
        raise ValueError("src, dst, nbytes and bucket must have one length")
    if s_arr.size and (
        s_arr.min() < 0 or s_arr.max() >= ns or d_arr.min() < 0 or d_arr.max() >= nd
    ):
        raise ValueError("a flow names a NIC outside the rates given")
    if (s_rate <= 0).any() or (d_rate <= 0).any():
        raise ValueError("NIC rates must be positive")
    src_bytes: FloatArray = np.bincount(s_arr, weights=v_arr, minlength=ns).astype(np.float64)
    dst_bytes: FloatArray = np.bincount(d_arr, weights=v_arr, minlength=nd).astype(np.float64)
    if writes is not None and write_overhead_s:
        w_arr = np.asarray(writes, dtype=np.float64)
        v_arr = v_arr + w_arr * write_overhead_s * s_rate[s_arr]
    keep = v_arr > 0
    s_arr, d_arr, v_arr, b_arr = s_arr[keep], d_arr[keep], v_arr[keep], b_arr[keep]

    # aggregate into (source, destination, bucket) flows
    flow_key = (s_arr * nd + d_arr) * (int(b_arr.max()) + 1 if b_arr.size else 1) + b_arr
    uniq, inv = np.unique(flow_key, return_inverse=True)
    f_bytes = np.bincount(inv, weights=v_arr)
    nb = int(b_arr.max()) + 1 if b_arr.size else 1
    f_pair = uniq // nb
    f_bucket = uniq % nb
    f_src = f_pair // nd

    # posting times per (source, bucket)
    sb = f_src * nb + f_bucket
    sent_sb = np.bincount(sb, weights=f_bytes, minlength=ns * nb).reshape(ns, nb)
    present = np.bincount(sb, minlength=ns * nb).reshape(ns, nb) > 0
    packed: FloatArray = sent_sb.astype(np.float64)
    if packed_bytes is not None:
        packed = np.zeros((ns, nb))
        for (s, b), v in packed_bytes.items():
            if s < ns and b < nb:
                packed[s, b] = v
    step_t = np.where(present, bucket_overhead_s + packed / pack_rate, 0.0)
    post_sb = np.cumsum(step_t, axis=1)
    f_post = post_sb.reshape(-1)[sb]

    # pairs: one fluid flow each, fed by its flows as they are posted
    pair_ids, f_pidx = np.unique(f_pair, return_inverse=True)
    npairs = pair_ids.shape[0]
    p_src = pair_ids // nd
    p_dst = pair_ids % nd
    fabric = Fabric(p_src, ns + p_dst, np.concatenate([s_rate, d_rate]))
    order = np.argsort(f_post, kind="stable")
    post_t, post_pair, post_bytes = f_post[order], f_pidx[order], f_bytes[order]

    backlog = np.zeros(npairs)
    p_finish = np.zeros(npairs)
    lands = _Landing(f_pidx, f_bytes, order, npairs) if land else None
    t = 0.0
    ptr = 0
    steps = 0
    active = np.zeros(0, dtype=np.int64)
    rates = np.zeros(0)
    total_posts = post_t.shape[0]
    dirty = True
    while True:
        # post every flow due by now
        if ptr < total_posts and post_t[ptr] <= t:
            end = int(np.searchsorted(post_t, t, side="right"))
            idx = post_pair[ptr:end]
            # a post to a pair already moving changes no rate, only when it drains
            dirty = dirty or bool((backlog[idx] <= 0).any())
            np.add.at(backlog, idx, post_bytes[ptr:end])
            if lands is not None:
                np.add.at(lands.posted, idx, post_bytes[ptr:end])
            ptr = end
        if dirty:
            mask = backlog > 0
            active = np.flatnonzero(mask)
            rates = fabric.rates(mask)[0][active]
            steps += 1
            dirty = False
        next_post = post_t[ptr] if ptr < total_posts else np.inf
        if active.size == 0:
            if next_post == np.inf:
                break
            t = float(next_post)
            continue
        drain = t + backlog[active] / rates
        first = float(drain.min())
        t_next = min(first, float(next_post))
        window = rel_tol * t_next
        if first <= t_next + window:
            t_end = max(t_next, float(drain[drain <= t_next + window].max()))
        else:
            t_end = t_next
        done = drain <= t_end
        backlog[active] -= rates * (t_end - t)
        gone = active[done]
        backlog[gone] = 0.0
        p_finish[gone] = drain[done]
        if lands is not None:
            lands.step(active, rates, backlog[active], t, np.where(done, drain, t_end))
        t = t_end
        dirty = gone.size > 0

    if lands is not None:
        lands.close(p_finish)
    src_finish = np.zeros(ns)
    dst_finish = np.zeros(nd)
    np.maximum.at(src_finish, p_src, p_finish)
    np.maximum.at(dst_finish, p_dst, p_finish)
    return SimResult(
        seconds=float(p_finish.max()) if npairs else 0.0,
        src_finish=src_finish,
        dst_finish=dst_finish,
        src_bytes=src_bytes,
        dst_bytes=dst_bytes,
        pairs=npairs,
        flows=int(uniq.shape[0]),
        steps=steps,
        flow_src=f_src if land else None,
        flow_dst=(f_pair % nd) if land else None,
        flow_bucket=f_bucket if land else None,
        flow_land=lands.at if lands is not None else None,
    )


class _Landing:
    """When each flow of a pair lands: its pair drains its flows in posting order, so a
    flow has landed once the pair's delivered bytes reach the bytes posted up to it."""

    def __init__(
        self, pair: IntArray, nbytes: npt.ArrayLike, post_order: IntArray, npairs: int
    ) -> None:
        n = pair.shape[0]
        rank = np.empty(n, dtype=np.int64)
        rank[post_order] = np.arange(n)
        self.by_pair = np.lexsort((rank, pair))  # flows grouped by pair, in posting order
        cum = np.cumsum(np.asarray(nbytes, dtype=np.float64)[self.by_pair])
        self.start = np.searchsorted(pair[self.by_pair], np.arange(npairs + 1))
        base = np.where(self.start[:-1] > 0, cum[np.maximum(self.start[:-1] - 1, 0)], 0.0)
        self.thr = cum - np.repeat(base, np.diff(self.start))
        self.next = self.start[:-1].copy()
        self.posted = np.zeros(npairs)
        self.at = np.full(n, np.nan)
        self._pair = pair

    def step(
        self, active: IntArray, rates: FloatArray, left: FloatArray, t: float, end: FloatArray
    ) -> None:
        """Pairs `active` moved at `rates` from `t` until `end` (each), `left` bytes of
        their backlog still to go."""
        done = self.posted[active] - np.maximum(left, 0.0)  # delivered by `end`
        before = done - rates * (end - t)
        cand, i = active, np.arange(active.shape[0])
        while cand.size:
            k = self.next[cand]
            ok = k < self.start[cand + 1]
            thr = self.thr[np.minimum(k, self.thr.shape[0] - 1)]
            hit = ok & (thr <= done[i] + 1e-9 * np.maximum(thr, 1.0))
            if not hit.any():
                break
            cand, i, k = cand[hit], i[hit], k[hit]
            when = t + np.maximum(self.thr[k] - before[i], 0.0) / rates[i]
            self.at[self.by_pair[k]] = np.minimum(when, end[i])
            self.next[cand] += 1

    def close(self, p_finish: FloatArray) -> None:
        """Any flow not marked (rounding at a pair's last byte) landed with its pair."""
        miss = np.isnan(self.at)
        if miss.any():
            self.at[miss] = p_finish[self._pair[miss]]
