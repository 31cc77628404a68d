"""Every bucket's writes, as arrays: its sends merged where both ends are contiguous, cut
into chunks of at most `max_write_bytes`, equal chunks evenly spaced at both ends
gathered into strided writes (one slice of every expert of a layer is one write, not one
per expert), and striped over the lanes both ends have. Each write has its own
immediate, so the destination counts writes (stripes included) exactly."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .options import PlanOptions

IntArray = npt.NDArray[np.int64]


@dataclass
class Writes:
    """In plan order: bucket by bucket (trainer-major), each bucket's writes in order."""

    bucket: IntArray  # global bucket index
    src: IntArray
    length: IntArray
    engine: IntArray  # engine index (rank order)
    region: IntArray  # destination region
    dst: IntArray
    lane: IntArray
    src_region: IntArray
    count: IntArray
    src_stride: IntArray
    dst_stride: IntArray

    @property
    def nbytes(self) -> IntArray:
        return self.length * self.count

    def __len__(self) -> int:
        return int(self.bucket.shape[0])


def order(*keys: IntArray) -> IntArray:
    """The stable order of rows by `keys` (the first the most significant), as
    np.lexsort(keys[::-1]) gives it: keys packed into one int64 where their ranges fit
    (each shifted to start at 0), one stable sort instead of one per key."""
    if not keys or keys[0].shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    packed = np.zeros(keys[0].shape[0], dtype=np.int64)
    bits = 0
    for k in keys:
        lo, hi = int(k.min()), int(k.max())
        width = max(1, (hi - lo).bit_length())
        if bits + width > 62:
            return np.lexsort(keys[::-1])
        packed <<= width
        packed |= k - lo
        bits += width
    return np.argsort(packed, kind="stable")


def _starts(*same: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    out = np.ones(same[0].shape[0] + 1, dtype=bool)
    cont = np.logical_and.reduce(same) if len(same) > 1 else same[0]
    out[1:] = ~cont
    return out


def writes_of(
    bucket: IntArray,
    engine: IntArray,
    engine_order: IntArray,
    region: IntArray,
    src_region: IntArray,
    src: IntArray,
    dst: IntArray,
    nbytes: IntArray,
    options: PlanOptions,
    bucket_lanes: IntArray,  # source lanes of each bucket's trainer
    engine_lanes: IntArray,
) -> Writes:
    """The writes of sends (one per chunk, in chunk order) from staging offset or region
    offset `src` to `dst` in `region` of `engine`."""
    cap = options.max_write_bytes
    if bucket.shape[0] == 0:
        z = bucket[:0]
        return Writes(z, z, z, z, z, z, z, z, z, z, z)
    eo = engine_order[engine]  # (node, rank) order of the destination
    by_src = np.argsort(src, kind="stable")
    o = by_src[order(*(x[by_src] for x in (bucket, eo, region, src_region)))]
    b, e, r, sr, s, d, n = (x[o] for x in (bucket, eo, region, src_region, src, dst, nbytes))
    same = _starts(b[1:] == b[:-1], e[1:] == e[:-1], r[1:] == r[:-1], sr[1:] == sr[:-1])
    contiguous = np.ones(b.shape[0], dtype=bool)
    contiguous[1:] = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    first = np.flatnonzero(same | ~contiguous)
    m_len = np.add.reduceat(n, first) if first.size else n[:0]
    m_b, m_e, m_r, m_sr, m_s, m_d = (x[first] for x in (b, e, r, sr, s, d))

    # chunks of at most `cap` bytes
    pieces = -(-m_len // cap)
    rep = np.repeat(np.arange(first.shape[0]), pieces)
    at = (np.arange(rep.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * cap
    c_n = np.minimum(cap, m_len[rep] - at)
    c_s, c_d = m_s[rep] + at, m_d[rep] + at
    c_b, c_e, c_r, c_sr = m_b[rep], m_e[rep], m_r[rep], m_sr[rep]

    # runs: chunks of one target and size, in source order, while evenly spaced
    by_src = np.argsort(c_s, kind="stable")
    o = by_src[order(*(x[by_src] for x in (c_b, c_e, c_r, c_sr, c_n)))]
    c_b, c_e, c_r, c_sr, c_n, c_s, c_d = (x[o] for x in (c_b, c_e, c_r, c_sr, c_n, c_s, c_d))
    start = _run_starts(c_b, c_e, c_r, c_sr, c_n, c_s, c_d, cap)
    heads = np.flatnonzero(start)
    count = np.diff(np.append(heads, start.shape[0]))
    multi = count > 1
    nxt = np.minimum(heads + 1, start.shape[0] - 1)
    ss = np.where(multi, c_s[nxt] - c_s[heads], 0)
    ds = np.where(multi, c_d[nxt] - c_d[heads], 0)
    r_b, r_e, r_r, r_sr, r_n, r_s, r_d = (x[heads] for x in (c_b, c_e, c_r, c_sr, c_n, c_s, c_d))
    return _stripes(
        r_b,
        r_e,
        r_r,
        r_sr,
        r_n,
        r_s,
        r_d,
        count,
        ss,
        ds,
        options,
        bucket_lanes,
        engine_lanes,
        engine_order,
    )


def _run_starts(
    b: IntArray,
    e: IntArray,
    r: IntArray,
    sr: IntArray,
    n: IntArray,
    s: IntArray,
    d: IntArray,
    cap: int,
) -> npt.NDArray[np.bool_]:
    """Where a run begins: a chunk joins the run before it when it has the same target and
    size, lies at least a block further at both ends, by the run's strides once it has
    two blocks, and the run stays within `cap` bytes."""
    start = _starts(
        b[1:] == b[:-1], e[1:] == e[:-1], r[1:] == r[:-1], sr[1:] == sr[:-1], n[1:] == n[:-1]
    )
    if s.shape[0] < 2:
        return start
    dss, dds = s[1:] - s[:-1], d[1:] - d[:-1]
    link = np.zeros(s.shape[0], dtype=bool)
    link[1:] = ~start[1:] & (dss >= n[1:]) & (dds >= n[1:]) & (2 * n[1:] <= cap)
    start = ~link
    same_step = np.zeros(s.shape[0], dtype=bool)
    same_step[2:] = (dss[1:] == dss[:-1]) & (dds[1:] == dds[:-1])
    idx = np.flatnonzero(link)
    if idx.size == 0:
        return start
    # Chunks linked one to the next form chains; within a chain, stretches of links of
    # one step. A run takes a chain's links while their step stays its own, up to
    # `cap // n` blocks; the link after a full or broken run is not taken (its chunk
    # begins the next run, which always takes the link after it). So along a stretch
    # the blocks of the run count 1, 2, ..., L, 1, 2, ...: only each stretch's first
    # link depends on the one before, and it is walked here; the rest is arithmetic.
    chain_first = ~link[idx - 1]
    first = np.flatnonzero(chain_first | ~same_step[idx])
    ends = np.append(first[1:], idx.shape[0]).tolist()
    most = (cap // n[idx[first]]).tolist()
    breaks: list[IntArray] = []
    count = 1  # blocks of the run holding the chunk before the stretch's first link
    for k0, k1, new_chain, limit in zip(
        first.tolist(), ends, chain_first[first].tolist(), most, strict=True
    ):
        before = 1 if new_chain else count
        if before == 1:
            c0 = 2
        else:  # the step changed under a run of two or more blocks: it ends there
            c0 = 1
            breaks.append(idx[k0 : k0 + 1])
        m = k1 - k0
        if m > 1:
            j0 = (limit - (c0 - 1)) % limit or limit  # next link whose run would overflow
            if j0 < m:
                breaks.append(idx[k0 + j0 : k1 : limit])
        count = (c0 - 1 + m - 1) % limit + 1
    if breaks:
        start[np.concatenate(breaks)] = True
    return start


def _stripes(
    b: IntArray,
    e: IntArray,
    r: IntArray,
    sr: IntArray,
    n: IntArray,
    s: IntArray,
    d: IntArray,
    count: IntArray,
    ss: IntArray,
    ds: IntArray,
    options: PlanOptions,
    bucket_lanes: IntArray,
    engine_lanes: IntArray,
    engine_order: IntArray,
) -> Writes:
    """Each run striped over the lanes both ends have: a single chunk by byte ranges, a
    strided run by whole blocks; each stripe a write on its own lane."""
    eng = np.argsort(engine_order)[e]  # back from (node, rank) order to the engine index
    if b.shape[0] == 0 or bucket_lanes.max() <= 1:  # one lane at every source: no stripes
        return Writes(
            bucket=b,
            src=s,
            length=n,
            engine=eng,
            region=r,
            dst=d,
            lane=np.zeros_like(b),
            src_region=sr,
            count=count,
            src_stride=ss,
            dst_stride=ds,
        )
    src_lanes = np.maximum(1, bucket_lanes[b])
    lanes = np.maximum(1, np.minimum(src_lanes, engine_lanes[eng]))
    k = np.maximum(1, np.minimum(lanes, n * count // max(1, options.min_stripe_bytes)))
    single = count == 1
    step = np.where(single, -(-n // k), 1)  # bytes per stripe of a single chunk
    per = np.where(single, 1, -(-count // np.minimum(k, count)))  # blocks per stripe
    parts = np.where(single, -(-n // step), -(-count // per))
    rep = np.repeat(np.arange(b.shape[0]), parts)
    part = np.arange(rep.shape[0]) - np.repeat(np.cumsum(parts) - parts, parts)
    one = single[rep]
    w_b = b[rep]
    # byte stripes of a single chunk / block stripes of a strided run
    off = np.where(one, part * step[rep], part * per[rep] * ss[rep])
    doff = np.where(one, part * step[rep], part * per[rep] * ds[rep])
    w_len = np.where(one, np.minimum(step[rep], n[rep] - part * step[rep]), n[rep])
    w_count = np.where(one, 1, np.minimum(per[rep], count[rep] - part * per[rep]))
    strided = w_count > 1
    # lanes: a write of one part goes round the lanes by its place in the bucket, the
    # parts of one write by their number
    bucket_first = np.searchsorted(w_b, w_b, side="left")
    place = np.arange(rep.shape[0]) - bucket_first
    sl = src_lanes[rep]
    lane = np.where(parts[rep] == 1, place % sl, part % sl)
    return Writes(
        bucket=w_b,
        src=s[rep] + off,
        length=w_len,
        engine=eng[rep],
        region=r[rep],
        dst=d[rep] + doff,
        lane=lane,
        src_region=sr[rep],
        count=w_count,
        src_stride=np.where(strided, ss[rep], 0),
        dst_stride=np.where(strided, ds[rep], 0),
    )
