"""A whole plan as arrays (`Compact`), and the per-node plans made from it on demand
(`PlanSet`): the coordinator holds the arrays and builds each daemon's `NodePlan` only
when it sends it, so no process ever holds every node's plan as objects."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from weightwire.protocol.plan import Bucket, Expect, NodePlan, PackOp, RankPlan, WriteOp
from weightwire.protocol.regions import RegionDescriptor

from .items import Keys
from .options import PlanOptions
from .sources import SourceIndex
from .staging import Packs
from .writes import Writes

if TYPE_CHECKING:
    from .ranks import EngineRank, TrainerRank

IntArray = npt.NDArray[np.int64]

FORMAT = "weightwire-plan-columnar-1"  # hashed with the plan: a new layout of it, a new hash


@dataclass
class Compact:
    job: str
    options: PlanOptions
    trainers: list[TrainerRank]  # by rank
    engines: list[EngineRank]  # by rank
    index: SourceIndex
    keys: Keys
    packs: Packs
    writes: Writes
    slots: dict[int, int]
    expect_count: IntArray  # per engine
    expect_bytes: IntArray
    expect_sources: list[tuple[str, ...]]
    regions: list[list[tuple[str, int]]]  # per trainer: (node, region) it writes to, sorted
    plan_hash: str = ""

    def digest(self) -> str:
        """The plan's hash: its inputs and every array of it."""
        h = hashlib.sha256()
        enc = msgspec.msgpack.Encoder(order="deterministic")
        h.update(enc.encode([FORMAT, self.job, self.options]))
        encoded: dict[int, bytes] = {}  # ranks often share one declaration: encode it once
        for t in self.trainers:
            if id(t.tensors) not in encoded:
                encoded[id(t.tensors)] = hashlib.sha256(enc.encode(t.tensors)).digest()
            h.update(enc.encode([t.node, t.rank, t.lanes]))
            h.update(encoded[id(t.tensors)])
        for e in self.engines:
            if id(e.tensors) not in encoded:
                encoded[id(e.tensors)] = hashlib.sha256(enc.encode(e.tensors)).digest()
            # the CUDA key too: a rank that released its memory is advertised without it,
            # and writers must get a new plan that lets their mapping of it go
            regions = [(r.id, r.length, r.keys.cuda) for r in e.regions]
            h.update(enc.encode([e.node, e.rank, e.lanes, self.slots[e.rank], regions]))
            h.update(encoded[id(e.tensors)])
        p, w = self.packs, self.writes
        for arr in (
            p.trainer, p.key, p.nbytes, p.bucket, p.offset, p.region,
            p.b_trainer, p.b_expert, p.b_nbytes, p.staging,
            w.bucket, w.src, w.length, w.engine, w.region, w.dst, w.lane,
            w.src_region, w.count, w.src_stride, w.dst_stride,
            self.expect_count, self.expect_bytes,
        ):  # fmt: skip
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(enc.encode([self.expect_sources, self.regions]))
        return h.hexdigest()[:16]

    # --------------------------------------------------------------- per node
    def rank_plan(self, t: int) -> RankPlan:
        """Trainer index t's plan."""
        p, w = self.packs, self.writes
        trainer = self.trainers[t]
        b_lo, b_hi = np.searchsorted(p.b_trainer, [t, t + 1]).tolist()
        w_bounds = np.searchsorted(w.bucket, np.arange(b_lo, b_hi + 1)).tolist()
        engines = self.engines
        keys = self.keys
        held: dict[str, object] = {}
        buckets = []
        for b in range(b_lo, b_hi):
            lo, hi = int(p.b_first_pack[b]), int(p.b_first_pack[b + 1])
            packs = []
            for i in range(lo, hi):
                if p.region[i] >= 0:
                    continue
                k = int(p.key[i])
                name = keys.source[k]
                box = held.get(name)
                if box is None:
                    box = held[name] = self.index.tensor(t, name).held()
                packs.append(
                    PackOp(
                        source=name,
                        box=keys.box[k].relative_to(box),  # type: ignore[arg-type]
                        transform=keys.transform[k],
                        staging_offset=int(p.offset[i]),
                        nbytes=int(p.nbytes[i]),
                    )
                )
            writes = []
            wl, wh = w_bounds[b - b_lo], w_bounds[b - b_lo + 1]
            cols = zip(
                *(
                    a[wl:wh].tolist()
                    for a in (
                        w.src,
                        w.length,
                        w.engine,
                        w.region,
                        w.dst,
                        w.lane,
                        w.src_region,
                        w.count,
                        w.src_stride,
                        w.dst_stride,
                    )
                ),
                strict=True,
            )
            for src, n, e, region, dst, lane, src_region, count, ss, ds in cols:
                rank = engines[e].rank
                writes.append(
                    WriteOp(
                        src_offset=src,
                        length=n,
                        dst_node=engines[e].node,
                        dst_region=region,
                        dst_offset=dst,
                        slot=self.slots[rank],
                        dst_rank=rank,
                        lane=lane,
                        src_region=src_region,
                        count=count,
                        src_stride=ss,
                        dst_stride=ds,
                    )
                )
            buckets.append(
                Bucket(
                    index=int(p.b_index[b]),
                    kind="experts" if p.b_expert[b] else "dense",
                    packs=tuple(packs),
                    writes=tuple(writes),
                    nbytes=int(p.b_nbytes[b]),
                )
            )
        by_key: dict[tuple[str, int], RegionDescriptor] = {}
        for e in engines:
            for r in e.regions:
                by_key[(e.node, r.id)] = r
        return RankPlan(
            plan_hash=self.plan_hash,
            rank=trainer.rank,
            staging_bytes=int(p.staging[t]),
            buckets=tuple(buckets),
            regions=tuple(by_key[k] for k in self.regions[t]),
        )

    def node_plan(self, node: str) -> NodePlan:
        sends = tuple(self.rank_plan(t) for t, tr in enumerate(self.trainers) if tr.node == node)
        expects = self.node_plan_expects(node)
        return NodePlan(plan_hash=self.plan_hash, job=self.job, sends=sends, expects=expects)

    def node_plan_expects(self, node: str) -> tuple[Expect, ...]:
        """What the engine ranks of `node` expect per version."""
        return tuple(
            Expect(
                rank=e.rank,
                slot=self.slots[e.rank],
                count=int(self.expect_count[i]),
                nbytes=int(self.expect_bytes[i]),
                sources=self.expect_sources[i],
            )
            for i, e in enumerate(self.engines)
            if e.node == node
        )


class PlanSet(Mapping[str, NodePlan]):
    """Node name -> that node's plan, each made from the arrays when asked for."""

    def __init__(self, compact: Compact) -> None:
        self.compact = compact
        nodes = {t.node for t in compact.trainers} | {e.node for e in compact.engines}
        self._nodes = sorted(nodes)
        self._known = set(nodes)

    @property
    def plan_hash(self) -> str:
        return self.compact.plan_hash

    @property
    def write_count(self) -> int:
        return len(self.compact.writes)

    def __getitem__(self, node: str) -> NodePlan:
        if node not in self._known:
            raise KeyError(node)
        return self.compact.node_plan(node)

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)
