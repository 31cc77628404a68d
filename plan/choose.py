"""Which trainer rank sends each chunk: for each chunk in order, the least-loaded rank
among those that hold it (ties: the lowest), each choice charging the chosen rank.

The choice is sequential by definition, so it is done in runs. A rank's key is
`load << shift | index`, so that one integer comparison orders (load, index) and no two
keys are equal. With the candidates' keys kept sorted, a run of k equal chunks of size s
goes to the k smallest keys in order when the k-th is below the smallest + s (each gets
one, none comes round again), or all to the smallest when it stays below the second;
other runs go one chunk at a time. Groups of candidates that share no rank are chosen
independently; overlapping groups (ranks holding different boxes of one tensor) take the
plain path, a lazy heap per group.
"""

from __future__ import annotations

import heapq
from bisect import insort

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


def choose(groups: IntArray, sizes: IntArray, members: list[tuple[int, ...]], n: int) -> IntArray:
    """The chosen rank index of each chunk; `groups[i]` indexes `members`, the sorted
    candidate rank indices of chunk i, whose bytes are `sizes[i]`. All loads start at 0."""
    out = np.empty(groups.shape[0], dtype=np.int64)
    if groups.shape[0] == 0:
        return out
    used = np.unique(groups).tolist()
    seen: set[int] = set()
    disjoint = True
    for g in used:
        if seen.intersection(members[g]):
            disjoint = False
            break
        seen.update(members[g])
    if not disjoint:
        return _plain(groups, sizes, members, n)
    for g in used:
        cand = members[g]
        where = np.flatnonzero(groups == g) if len(used) > 1 else slice(None)
        if len(cand) == 1:
            out[where] = cand[0]
        else:
            local = _runs(sizes[where], len(cand))
            out[where] = np.asarray(cand, dtype=np.int64)[local]
    return out


def _runs(sizes: IntArray, n: int) -> IntArray:
    """Least-loaded choice over n ranks (all loads 0 at first) of chunks of `sizes`."""
    shift = max(1, (n - 1).bit_length())
    mask = (1 << shift) - 1
    edges = np.flatnonzero(sizes[1:] != sizes[:-1]) + 1
    starts = np.concatenate([[0], edges]).tolist()
    lengths = np.diff(np.concatenate([[0], edges, [sizes.shape[0]]])).tolist()
    run_sizes = (sizes[np.asarray(starts, dtype=np.int64)] << shift).tolist()
    keys = list(range(n))  # sorted: (load 0, index)
    out: list[int] = []
    add, extend = out.append, out.extend
    for s, k in zip(run_sizes, lengths, strict=True):
        if k == 1:
            x = keys.pop(0)
            add(x & mask)
            insort(keys, x + s)
        elif k <= n and keys[k - 1] < keys[0] + s:  # k distinct ranks, in key order
            head = keys[:k]
            extend([x & mask for x in head])
            keys = keys[k:] + [x + s for x in head]
            keys.sort()  # two sorted runs: a merge
        elif n == 1 or keys[0] + (k - 1) * s < keys[1]:  # all to the least loaded
            x = keys.pop(0)
            extend([x & mask] * k)
            insort(keys, x + k * s)
        else:
            for _ in range(k):
                x = keys.pop(0)
                add(x & mask)
                insort(keys, x + s)
    return np.asarray(out, dtype=np.int64)


def _plain(groups: IntArray, sizes: IntArray, members: list[tuple[int, ...]], n: int) -> IntArray:
    """One chunk at a time: a heap of (load, index) per candidate group, updated lazily
    when a rank was charged through another group."""
    load = [0] * n
    heaps: dict[int, list[tuple[int, int]]] = {}
    out: list[int] = []
    for g, size in zip(groups.tolist(), sizes.tolist(), strict=True):
        cand = members[g]
        if len(cand) == 1:
            i = cand[0]
        else:
            heap = heaps.get(g)
            if heap is None:
                heap = heaps[g] = [(load[i], i) for i in cand]
                heapq.heapify(heap)
            while True:
                current, i = heap[0]
                if current == load[i]:
                    break
                heapq.heapreplace(heap, (load[i], i))
        load[i] += size
        out.append(i)
    return np.asarray(out, dtype=np.int64)
