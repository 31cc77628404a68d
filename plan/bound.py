"""The busiest-NIC lower bound of a weight sync: the time no plan can beat.

It comes from the model and the topology alone, never from a plan. One NIC per GPU:

- every engine GPU must receive its own shard (its TP/EP slice of every tensor it holds,
  FP8 codes and scales or bf16, vocabulary padding excluded: padding stays on the
  engine), through its own NIC: `max over engine GPUs of need / its NIC rate`;
- every byte that lands on an engine GPU leaves some trainer GPU's NIC:
  `sum of the needs / the trainers' total NIC rate`.

The bound is the larger of the two. (Trainers all hold every tensor, gathered, so no
trainer is forced to carry a particular byte; with sharded holders the bound could only
be larger.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import ITEMSIZE, Zeros, piece_nbytes


@dataclass(frozen=True)
class Bound:
    engine_bytes: tuple[int, ...]  # what each engine GPU must receive, engine rank order
    trainers: int
    engine_nic_Bps: float
    trainer_nic_Bps: float

    @property
    def total_bytes(self) -> int:
        return sum(self.engine_bytes)

    @property
    def engine_s(self) -> float:
        """The busiest engine NIC: its bytes at its line rate."""
        return max(self.engine_bytes, default=0) / self.engine_nic_Bps

    @property
    def trainer_s(self) -> float:
        """All bytes through all trainer NICs at once."""
        return self.total_bytes / (self.trainers * self.trainer_nic_Bps)

    @property
    def seconds(self) -> float:
        return max(self.engine_s, self.trainer_s)

    @property
    def limited_by(self) -> str:
        return "engine NIC" if self.engine_s >= self.trainer_s else "trainer NICs"


def received_bytes(tensors: Iterable[Any]) -> int:
    """Bytes an engine rank must receive for these tensors (each with `dtype`, `shape`,
    `pieces`): the whole tensors less their zero padding, which is never sent."""
    total = 0
    for t in tensors:
        total += math.prod(t.shape) * ITEMSIZE[t.dtype]
        for p in t.pieces:
            if isinstance(p.transform, Zeros):
                total -= piece_nbytes(t.dtype, p)
    return total


def layout_of(
    config: Mapping[str, Any], tp: int, tp_rank: int, ep: int, dest_dtype: str, replica: int = 0
) -> EngineLayout:
    """The SGLang layout of engine GPU `tp_rank` in a replica of `tp` GPUs with `ep`
    expert-parallel groups (SGLang's EP rank is tp_rank // (tp / ep))."""
    return EngineLayout(
        tp_size=tp,
        tp_rank=tp_rank,
        ep_size=ep,
        ep_rank=tp_rank // (tp // ep),
        replica=replica,
        model=dict(config),
        dest_dtype=dest_dtype,
    )


def model_bound(
    config: Mapping[str, Any],
    *,
    trainers: int,
    replicas: int,
    tp: int,
    ep: int,
    dest_dtype: str,
    nic_Bps: float,
    trainer_nic_Bps: float | None = None,
) -> Bound:
    """The bound for `replicas` engines of `tp` GPUs each (ranks replica-major) fed by
    `trainers` GPUs, every NIC at `nic_Bps` bytes per second (trainers' may differ)."""
    from weightwire.plan.rules import engine_tensors

    per_rank = [
        received_bytes(engine_tensors(config, layout_of(config, tp, r, ep, dest_dtype)))
        for r in range(tp)
    ]
    return bound_of(per_rank * replicas, trainers, nic_Bps, trainer_nic_Bps)


def bound_of(
    engine_bytes: Sequence[int],
    trainers: int,
    nic_Bps: float,
    trainer_nic_Bps: float | None = None,
) -> Bound:
    if trainers < 1 or nic_Bps <= 0:
        raise ValueError("need at least one trainer and a positive NIC rate")
    return Bound(
        engine_bytes=tuple(int(b) for b in engine_bytes),
        trainers=trainers,
        engine_nic_Bps=nic_Bps,
        trainer_nic_Bps=trainer_nic_Bps or nic_Bps,
    )
