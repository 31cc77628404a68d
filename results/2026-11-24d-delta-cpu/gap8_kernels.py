"""A 1-byte position gap encoding, measured and not adopted (see README.md): the gaps of
changes held in BLOCK16 form (`gaps_of`: one byte each, 255 then a uint32 as the escape;
each block diffed whole in int64, or in uint16, which LLVM vectorizes) and back to
BLOCK16 form, checked (`blocks_of`), for one 256 MiB bf16 bucket at 4.2 %, 1 % and
0.3 %, best of 5, against a copy of the low position bits (what BLOCK16's encode does).

    .venv/bin/python results/2026-11-24d-delta-cpu/gap8_kernels.py
"""

import time

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _escaped(low, i, c, base, prev, out, at):
    """One block's gaps, one at a time, with the escape; bytes used, -1 past out's end."""
    m = out.size
    for j in range(c):
        p = base | np.int64(low[i + j])
        g = p - prev - 1
        prev = p
        if g < 255:
            if at >= m:
                return -1
            out[at] = g
            at += 1
        else:
            if at + 5 > m:
                return -1
            out[at] = 255
            for s in range(4):
                out[at + 1 + s] = (g >> (8 * s)) & 0xFF
            at += 5
    return at


@numba.njit(cache=True, nogil=True)
def _diff8(lb, ob):
    """ob[j] := lb[j] - lb[j - 1] - 1 (j >= 1, low byte), in uint16: LLVM vectorizes it;
    the largest difference."""
    mx = np.uint16(0)
    for j in range(1, lb.size):
        d = np.uint16(lb[j] - lb[j - 1])
        ob[j] = np.uint8(d - np.uint16(1))
        mx = max(mx, d)
    return mx


@numba.njit(cache=True, nogil=True)
def _diff8_scalar(lb, ob):
    """`_diff8` in int64 (what LLVM did not vectorize: 10x slower)."""
    mx = np.int64(0)
    for j in range(1, lb.size):
        d = np.int64(lb[j]) - np.int64(lb[j - 1])
        ob[j] = np.uint8((d - 1) & 0xFF)
        mx = max(mx, d)
    return mx


@numba.njit(cache=True, nogil=True)
def gaps_of(counts, low, nblocks, out, vector):
    """GAP8 gaps of changes in BLOCK16 form into out; bytes written, -1 past out's end.
    A block is diffed whole, then redone one gap at a time if a gap was 255 or more."""
    at = 0
    prev = np.int64(-1)
    i = 0
    for b in range(nblocks):
        c = np.int64(counts[b])
        if c == 0:
            continue
        base = np.int64(b) << 16
        if at + c > out.size:
            return -1
        g0 = (base | np.int64(low[i])) - prev - 1
        lb, ob = low[i : i + c], out[at : at + c]
        mx = np.int64(_diff8(lb, ob)) if vector else _diff8_scalar(lb, ob)
        out[at] = np.uint8(g0 & 0xFF)
        if g0 < 255 and mx < 256:
            at += c
        else:
            at = _escaped(low, i, c, base, prev, out, at)
            if at < 0:
                return -1
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
        spent = {}
        for vector in (False, True):
            ref = gaps_of(counts, low, nb, out, vector)
            t = []
            for _ in range(5):
                t0 = time.perf_counter()
                m = gaps_of(counts, low, nb, out, vector)
                t.append(time.perf_counter() - t0)
            spent[vector] = min(t)
            assert m == ref
        g = np.diff(np.concatenate([[-1], pos])) - 1
        plain = g < 255  # the bytes without an escape, in order, are those gaps
        assert m == k + 4 * int((~plain).sum())
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
            f"d={d} k={k} gap bytes/k={m / k:.3f} encode {spent[False] * 1e3:.2f} ms "
            f"(vectorized {spent[True] * 1e3:.2f} ms) "
            f"decode {min(t2) * 1e3:.2f} ms (copy of low {min(cp) * 1e3:.2f} ms) ok={ok}"
        )
