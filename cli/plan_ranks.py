"""The cluster `weightwire plan` plans for: its topology, N trainer ranks that each hold
every HF tensor whole, and the engine ranks laid out the way SGLang holds the model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import DestTensor, SourceTensor

if TYPE_CHECKING:  # the planner loads only when the command runs
    from weightwire.plan.planner import EngineRank, TrainerRank

ALIGN = 256  # engine tensors start on 256-byte boundaries in their region


@dataclass(frozen=True)
class Topology:
    trainers: int
    replicas: int
    tp: int
    ep: int
    nic_gbps: float  # Gbit/s per GPU NIC, trainers and engines alike

    @property
    def engines(self) -> int:
        return self.replicas * self.tp

    @property
    def nic_Bps(self) -> float:
        return self.nic_gbps * 1e9 / 8


def trainer_ranks(config: Mapping[str, Any], n: int, dtype: str = "bfloat16") -> list[TrainerRank]:
    """N trainer ranks, each holding every HF tensor whole (gathered before sending)."""
    from weightwire.plan.planner import TrainerRank
    from weightwire.plan.rules import hf_tensors

    held = tuple(
        SourceTensor(name=t.name, dtype=t.dtype, shape=t.shape)  # type: ignore[arg-type]
        for t in hf_tensors(config, dtype)
    )
    return [TrainerRank(f"trainer-{i}", i, held) for i in range(n)]


def engine_ranks(
    config: Mapping[str, Any], topo: Topology, dest_dtype: str, replicas: Sequence[int]
) -> list[EngineRank]:
    """The engine GPUs of the given replicas, rank replica * tp + tp_rank, each on a node of
    its own (one NIC per GPU), its SGLang tensors packed into one region."""
    from weightwire.plan.bound import layout_of
    from weightwire.plan.planner import EngineRank
    from weightwire.plan.rules import engine_tensors

    per_tp: list[tuple[tuple[DestTensor, ...], int]] = []
    for r in range(topo.tp):
        placed: list[DestTensor] = []
        offset = 0
        for t in engine_tensors(config, layout_of(config, topo.tp, r, topo.ep, dest_dtype)):
            placed.append(
                DestTensor(
                    name=t.name,
                    dtype=t.dtype,  # type: ignore[arg-type]
                    shape=t.shape,
                    region=1,
                    offset=offset,
                    pieces=t.pieces,
                )
            )
            offset += -(-placed[-1].nbytes // ALIGN) * ALIGN
        per_tp.append((tuple(placed), offset))
    out = []
    for rep in replicas:
        for r, (tensors, length) in enumerate(per_tp):
            node = f"engine-{rep}-{r}"
            region = RegionDescriptor(id=1, node=node, kind="gpu", length=max(length, 1))
            out.append(EngineRank(node, rep * topo.tp + r, tensors, (region,)))
    return out
