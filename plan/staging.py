"""Every trainer rank's packs, as arrays: one per (rank, chunk key) it sends, laid out in
its staging region (dense first, then experts; engines interleaved block by block, each
block in tensor order, so every engine is fed from the start and neighbouring tensors
merge into one write), and cut into buckets of at most `bucket_bytes` (a larger pack
alone), a bucket never mixing dense and experts. The last `bucket_bytes` of each trainer
rank's send are cut into buckets of at most `tail_bytes` (where that is smaller): what
is left after its last bucket is packed (crossing the link; a delta's apply and check
at the engine) is a small bucket's worth instead of a whole one."""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .writes import order

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass
class Packs:
    """Packs sorted by (trainer, staging order); buckets numbered per trainer."""

    trainer: IntArray
    key: IntArray
    nbytes: IntArray
    bucket: IntArray  # global bucket index
    offset: IntArray  # in staging, or (region >= 0) in that region of the rank
    region: IntArray
    of_item: IntArray  # the pack of each chunk
    # buckets, trainer-major
    b_trainer: IntArray
    b_index: IntArray  # within its trainer
    b_expert: BoolArray
    b_nbytes: IntArray  # staging bytes packed
    b_first_pack: IntArray  # b_first_pack[b] .. b_first_pack[b + 1]: its packs
    staging: IntArray  # staging bytes per trainer


def pack_layout(
    chosen: IntArray,
    key: IntArray,
    block: IntArray,  # destination offset // bucket_bytes of each chunk
    expert: BoolArray,
    key_nbytes: IntArray,
    key_align: IntArray,
    trainers: int,
    bucket_bytes: int,
    zero_copy: Callable[[int, int], tuple[int, int] | None] | None = None,
    tail_bytes: int = 0,
) -> Packs:
    nkeys = max(1, int(key_nbytes.shape[0]))
    uniq, first, inv = np.unique(chosen * nkeys + key, return_index=True, return_inverse=True)
    p_trainer, p_key = uniq // nkeys, uniq % nkeys
    p_expert = expert[first]
    # (trainer, kind, block, engine rank, tensor, piece, first chunk): chunks are laid end
    # to end in (engine rank, tensor, piece) order, so the first chunk's place orders
    # the last four
    sort = order(p_trainer, p_expert.astype(np.int64), block[first], first)
    rank_of = np.empty_like(sort)
    rank_of[sort] = np.arange(sort.shape[0])
    p_trainer, p_key, p_expert = p_trainer[sort], p_key[sort], p_expert[sort]
    nbytes = key_nbytes[p_key]
    region = np.full(sort.shape[0], -1, dtype=np.int64)
    offset = np.zeros(sort.shape[0], dtype=np.int64)
    if zero_copy is not None:
        for i, (t, k) in enumerate(zip(p_trainer.tolist(), p_key.tolist(), strict=True)):
            zc = zero_copy(t, k)
            if zc is not None:
                region[i], offset[i] = zc

    # buckets: a new one where the kind changes (or the trainer), or where the next pack
    # would overflow a bucket that holds anything; a trainer's last bucket_bytes (from
    # the first pack that ends within them) in buckets of tail_bytes
    bounds = np.searchsorted(p_trainer, np.arange(trainers + 1))
    cum = np.concatenate([[0], np.cumsum(nbytes)]).tolist()
    kind_edge = (
        np.flatnonzero((p_expert[1:] != p_expert[:-1]) | (p_trainer[1:] != p_trainer[:-1])) + 1
    )
    segs = sorted(set(kind_edge.tolist()) | set(bounds.tolist()))
    ends = set(bounds.tolist())
    taper = 0 < tail_bytes < bucket_bytes
    starts: list[int] = []

    def cut(lo: int, hi: int, cap: int) -> None:
        s = lo
        while s < hi:
            starts.append(s)
            fits = bisect_right(cum, cum[s] + cap, s, hi + 1) - 1
            empty = bisect_right(cum, cum[s], s, hi + 1)  # packs of 0 bytes join any bucket
            s = min(hi, max(s + 1, fits, empty))

    for lo, hi in itertools.pairwise(segs):
        tail = bisect_left(cum, cum[hi] - bucket_bytes, lo, hi + 1) if taper and hi in ends else hi
        cut(lo, tail, bucket_bytes)
        cut(tail, hi, tail_bytes)
    b_first = np.asarray([*starts, sort.shape[0]], dtype=np.int64)
    nb = len(starts)
    b_of_pack = np.repeat(np.arange(nb, dtype=np.int64), np.diff(b_first))
    b_trainer = p_trainer[b_first[:-1]] if nb else np.zeros(0, dtype=np.int64)
    t_first_bucket = np.searchsorted(b_trainer, np.arange(trainers + 1))
    b_index = np.arange(nb, dtype=np.int64) - t_first_bucket[b_trainer]
    b_expert = p_expert[b_first[:-1]] if nb else np.zeros(0, dtype=bool)

    # staging offsets: each pack aligned (4 bytes for scales, 16 for the rest)
    staged = region < 0
    sizes = np.where(staged, nbytes, 0)
    align = key_align[p_key]
    staging = np.zeros(trainers, dtype=np.int64)
    for t in range(trainers):
        lo, hi = int(bounds[t]), int(bounds[t + 1])
        if lo == hi:
            continue
        part = sizes[lo:hi]
        off = np.concatenate([[0], np.cumsum(part)])
        st = staged[lo:hi]
        if not (off[:-1][st] % align[lo:hi][st]).any():
            offset[lo:hi][st] = off[:-1][st]
            staging[t] = off[-1]
            continue
        pos = 0  # some pack needs padding: place them one by one
        for i in np.flatnonzero(st).tolist():
            a = int(align[lo + i])
            pos = -(-pos // a) * a
            offset[lo + i] = pos
            pos += int(part[i])
        staging[t] = pos
    b_nbytes = np.add.reduceat(sizes, b_first[:-1]) if nb else np.zeros(0, dtype=np.int64)
    return Packs(
        trainer=p_trainer,
        key=p_key,
        nbytes=nbytes,
        bucket=b_of_pack,
        offset=offset,
        region=region,
        of_item=rank_of[inv.reshape(-1)],
        b_trainer=b_trainer,
        b_index=b_index,
        b_expert=b_expert,
        b_nbytes=b_nbytes,
        b_first_pack=b_first,
        staging=staging,
    )
