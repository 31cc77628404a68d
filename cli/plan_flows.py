"""A plan's writes as arrays (`Flows`), straight from its columnar form, for the
simulator: sources, destinations, sizes, buckets, and each trainer's staging bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy and the planner load only when the command runs
    import numpy as np

    from weightwire.plan.compact import PlanSet


@dataclass
class Flows:
    """Every write of a plan, as arrays (source = trainer index, destination = engine index)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    bucket: np.ndarray
    packed: dict[tuple[int, int], float]
    staging: list[int]  # staging bytes per trainer if it staged its whole send at once
    ring: list[int]  # staging bytes per trainer with a ring of `ring_slots` bucket slots
    ring_slots: int = 0
    plan_hash: str = ""

    @property
    def writes(self) -> int:
        return int(self.src.shape[0])


def _ring_bytes(p: Any, trainers: list[int], slots: int) -> list[int]:
    """Each trainer's staging with a ring of `slots` slots: what `protocol.plan.staging_ring`
    gives its rank plan (slots of the largest staged bucket's span, or the whole send when a
    ring would not be smaller), computed on the columnar plan."""
    import numpy as np

    from weightwire.protocol.plan import RING_ALIGN

    whole = [int(n) for n in p.staging.tolist()]
    staged = np.flatnonzero(p.region < 0)
    if slots <= 0 or staged.size == 0:
        return whole
    bucket = p.bucket[staged]
    lo = np.full(p.b_trainer.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(p.b_trainer.shape[0], dtype=np.int64)
    np.minimum.at(lo, bucket, p.offset[staged])
    np.maximum.at(hi, bucket, p.offset[staged] + p.nbytes[staged])
    has = hi > 0
    span = np.where(has, hi - (lo - lo % RING_ALIGN), 0)
    out = list(whole)
    for t in range(len(trainers)):
        mine = (p.b_trainer == t) & has
        count = int(mine.sum())
        if count == 0:
            continue
        slot = -(-int(span[mine].max()) // RING_ALIGN) * RING_ALIGN
        if slots < count and slots * slot < whole[t]:
            out[t] = slots * slot
    return out


def flows_of(plans: PlanSet, trainers: int, ring_slots: int = 0) -> Flows:
    """The writes of a plan as arrays, straight from its columnar form (no NodePlan is made)."""
    import numpy as np

    c = plans.compact
    p, w = c.packs, c.writes
    t_rank = np.asarray([t.rank for t in c.trainers], dtype=np.int64)
    e_rank = np.asarray([e.rank for e in c.engines], dtype=np.int64)
    b_rank = t_rank[p.b_trainer]
    staging, ring = [0] * trainers, [0] * trainers
    ring_of = _ring_bytes(p, t_rank.tolist(), ring_slots)
    for rank, nbytes, held in zip(t_rank.tolist(), p.staging.tolist(), ring_of, strict=True):
        staging[rank], ring[rank] = nbytes, held
    packed = {
        (r, b): float(n)
        for r, b, n in zip(b_rank.tolist(), p.b_index.tolist(), p.b_nbytes.tolist(), strict=True)
    }
    return Flows(
        src=b_rank[w.bucket],
        dst=e_rank[w.engine],
        nbytes=w.nbytes.astype(np.float64),
        bucket=p.b_index[w.bucket],
        packed=packed,
        staging=staging,
        ring=ring,
        ring_slots=ring_slots,
        plan_hash=plans.plan_hash,
    )
