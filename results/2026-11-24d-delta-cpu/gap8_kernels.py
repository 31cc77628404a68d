"""A 1-byte position gap encoding, measured and not adopted (see README.md): the gaps of
changes held in BLOCK16 form (`gaps_of`: one byte each, 255 then a uint32 as the escape)
and back to BLOCK16 form, checked (`blocks_of`), for one 256 MiB bf16 bucket at 4.2 %,
1 % and 0.3 %, best of 5, against a copy of the low position bits (what BLOCK16's encode
does).

    .venv/bin/python results/2026-11-24d-delta-cpu/gap8_kernels.py
"""

import time

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def gaps_of(counts, low, nblocks, out):
    """GAP8 gaps of changes in BLOCK16 form into out; bytes written, -1 past out's end."""
    at = 0
    m = out.size
    prev = np.int64(-1)
    i = 0
    for b in range(nblocks):
        c = np.int64(counts[b])
        base = np.int64(b) << 16
        if c == 0:
            continue
        # block's first change: a gap from prev
        # common case: all gaps inside the block < 255 -> vectorizable diff
        if at + c > m:
            return -1
        first = base | np.int64(low[i])
        g0 = first - prev - 1
        out[at] = np.uint8(g0 & 0xFF)
        mx = np.int64(0)
        for j in range(1, c):
            d = np.int64(low[i + j]) - np.int64(low[i + j - 1])
            out[at + j] = np.uint8((d - 1) & 0xFF)
            mx = max(mx, d)
        if g0 < 255 and mx < 256:
            at += c
        else:
            p_prev = prev
            for j in range(c):
                p = base | np.int64(low[i + j])
                g = p - p_prev - 1
                p_prev = p
                if g < 255:
                    if at >= m:
                        return -1
                    out[at] = g
                    at += 1
                else:
                    if at + 5 > m:
                        return -1
                    out[at] = 255
                    out[at + 1] = g & 0xFF
                    out[at + 2] = (g >> 8) & 0xFF
                    out[at + 3] = (g >> 16) & 0xFF
                    out[at + 4] = (g >> 24) & 0xFF
                    at += 5
        prev = base | np.int64(low[i + c - 1])
        i += c
    return at


@numba.njit(cache=True, nogil=True)
def blocks_of(gaps, k, n, counts, low):
    i = 0
    at = 0
    m = gaps.size
    prev = np.int64(-1)
    while i < k:
        if at >= m:
            return 3
        g = np.int64(gaps[at])
        at += 1
        if g == 255:
            if at + 4 > m:
                return 3
            g = (
                np.int64(gaps[at])
                | (np.int64(gaps[at + 1]) << 8)
                | (np.int64(gaps[at + 2]) << 16)
                | (np.int64(gaps[at + 3]) << 24)
            )
            at += 4
        p = prev + 1 + g
        if p >= n:
            return 2
        counts[p >> 16] += 1
        low[i] = p & 0xFFFF
        prev = p
        i += 1
    return 0 if at == m else 3


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    n = 128 << 20  # 256 MiB bf16
    for d in (0.042, 0.01, 0.003):
        pos = np.flatnonzero(rng.random(n, dtype=np.float32) < d)
        k = pos.size
        nb = -(-n // 65536)
        counts = np.bincount(pos >> 16, minlength=nb).astype(np.uint32)
        low = (pos & 0xFFFF).astype(np.uint16)
        out = np.empty(k * 5 + 16, np.uint8)
        m = gaps_of(counts, low, nb, out)
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            m = gaps_of(counts, low, nb, out)
            t.append(time.perf_counter() - t0)
        c2 = np.zeros(nb, np.uint32)
        l2 = np.empty(k, np.uint16)
        r = blocks_of(out[:m], k, n, c2, l2)
        t2 = []
        for _ in range(5):
            c2[:] = 0
            t0 = time.perf_counter()
            r = blocks_of(out[:m], k, n, c2, l2)
            t2.append(time.perf_counter() - t0)
        ok = r == 0 and (c2 == counts).all() and (l2 == low).all()
        cp = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(l2, low)
            cp.append(time.perf_counter() - t0)
        print(
            f"d={d} k={k} gap bytes/k={m / k:.3f} encode {min(t) * 1e3:.2f} ms "
            f"decode {min(t2) * 1e3:.2f} ms (copy of low {min(cp) * 1e3:.2f} ms) ok={ok}"
        )
