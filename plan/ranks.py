"""A job's ranks as the planner takes them (what each trainer rank holds, what each engine
rank needs and where), and the small helpers the planner's modules share. Apart from
planner.py so that its parts (columnar, items, compact) import these without importing
the planner, which loads them."""

from __future__ import annotations

from dataclasses import dataclass

from weightwire.protocol.local import EngineLayout
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import DestTensor, SourceTensor


@dataclass(frozen=True)
class TrainerRank:
    node: str
    rank: int
    tensors: tuple[SourceTensor, ...]
    lanes: int = 1  # NICs its node has for it: writes are striped over them


@dataclass(frozen=True)
class EngineRank:
    node: str
    rank: int
    tensors: tuple[DestTensor, ...]  # each with its pieces resolved
    regions: tuple[RegionDescriptor, ...]
    slot: int = -1  # its immediate counter on its node (-1: numbered here)
    layout: EngineLayout | None = None  # for tensors whose recipes are left to the rules
    lanes: int = 1


def is_expert(name: str) -> bool:
    return ".experts." in name


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … and {len(names) - limit} more" if len(names) > limit else "")
