"""What a delta version moves, for the simulator: the dense flows of a plan turned into
the payloads and trailers a sparse version at a given density sends instead.

Per (source, destination, bucket): one payload (header, block table, the smallest
encoding of `density` x elements changed, as `weightwire.protocol.delta` sizes it),
in as many writes as the dense ones; dense again where the payload would not be
smaller. Per (source, destination): one trailer, after the last bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from weightwire.protocol import delta
from weightwire.protocol.plan import DELTA_HEAD, DELTA_RANGE, DELTA_REF


@dataclass(frozen=True)
class DeltaFlows:
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.float64]
    bucket: npt.NDArray[np.int64]
    writes: npt.NDArray[np.float64]
    payloads: int
    dense_groups: int  # (source, destination, bucket) groups that stay dense
    dense: npt.NDArray[np.float64] | None = None  # dense bytes each flow stands for
    # (what the engine checksums for it; 0 for the trailers)
    applied: npt.NDArray[np.float64] | None = None  # of them, those sent as a payload
    # (what the engine decodes and scatters)


def delta_flows(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    nbytes: npt.ArrayLike,
    bucket: npt.ArrayLike,
    *,
    density: float,
    width: int,
) -> DeltaFlows:
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    v = np.asarray(nbytes, dtype=np.float64)
    b = np.asarray(bucket, dtype=np.int64)
    if s.size == 0:
        empty = np.zeros(0)
        return DeltaFlows(s, d, empty, b, empty, 0, 0)
    keys, inverse, counts = np.unique(
        np.stack([s, d, b], axis=1), axis=0, return_inverse=True, return_counts=True
    )
    dense = np.bincount(inverse.reshape(-1), weights=v, minlength=len(keys))
    n = dense.astype(np.int64) // width
    k = np.ceil(density * n).astype(np.int64)
    head = -(-(DELTA_HEAD + DELTA_RANGE * counts.astype(np.int64)) // 8) * 8
    # the sizes' arithmetic works on arrays as on ints: each group's smallest encoding
    body = np.minimum.reduce([delta.body_size(kind, n, k, width) for kind in delta.SPARSE])  # type: ignore[arg-type]
    payload = (head + body).astype(np.float64)
    smaller = payload < dense
    out_bytes = np.where(smaller, payload, dense)
    payloads, kept = int(smaller.sum()), int((~smaller).sum())
    pairs, pair_inv = np.unique(keys[:, :2], axis=0, return_inverse=True)
    pair_writes = np.bincount(
        np.unique(np.stack([s, d], axis=1), axis=0, return_inverse=True)[1].reshape(-1),
        minlength=len(pairs),
    )
    groups_per_pair = np.bincount(pair_inv.reshape(-1), minlength=len(pairs))
    last = np.zeros(int(s.max()) + 1, dtype=np.int64)
    np.maximum.at(last, s, b)
    trailer = DELTA_HEAD + DELTA_RANGE * pair_writes + DELTA_REF * groups_per_pair
    return DeltaFlows(
        src=np.concatenate([keys[:, 0], pairs[:, 0]]),
        dst=np.concatenate([keys[:, 1], pairs[:, 1]]),
        nbytes=np.concatenate([np.asarray(out_bytes), trailer.astype(np.float64)]),
        bucket=np.concatenate([keys[:, 2], last[pairs[:, 0]]]),
        writes=np.concatenate([counts.astype(np.float64), np.ones(len(pairs))]),
        payloads=payloads,
        dense_groups=kept,
        dense=np.concatenate([dense, np.zeros(len(pairs))]),
        applied=np.concatenate([np.where(smaller, dense, 0.0), np.zeros(len(pairs))]),
    )


def verify_queue(
    dst: npt.NDArray[np.int64],
    land: npt.NDArray[np.float64],
    work: npt.NDArray[np.float64],
    engines: int,
) -> npt.NDArray[np.float64]:
    """Per engine: when it has checksummed every flow it received, checking each flow
    (`work` seconds) once it landed (`land`), one at a time in landing order (its
    daemon tells it bucket by bucket). An engine that receives nothing: 0."""
    done = np.zeros(engines)
    if dst.size == 0:
        return done
    order = np.lexsort((land, dst))
    d, t, w = dst[order], land[order], work[order]
    start = np.searchsorted(d, np.arange(engines + 1))
    cw = np.cumsum(w)
    base = np.where(start[:-1] > 0, cw[np.maximum(start[:-1] - 1, 0)], 0.0)
    cw = cw - np.repeat(base, np.diff(start))  # within each engine
    # finish_k = cw_k + max over j <= k of (land_j - cw_(j-1)), per engine
    a = t - (cw - w)
    span = float(np.abs(a).max()) * 2 + 1.0
    a = a + d * span  # groups sorted: a running max that never crosses a group
    run = np.maximum.accumulate(a) - d * span
    finish = cw + run
    last = start[1:] - 1
    has = np.diff(start) > 0
    done[has] = finish[last[has]]
    return done
