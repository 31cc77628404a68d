"""The static routing plan: who packs what, and who writes it where.

Pure, deterministic, and free of I/O: the same registrations and options give the
same plan and the same hash, whatever order they arrived in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from weightwire.protocol.errors import PlanError
from weightwire.protocol.plan import MAX_SLOTS
from weightwire.protocol.tensors import (
    ITEMSIZE,
    transformed_itemsize,
)

from .options import PlanOptions
from .ranks import EngineRank, TrainerRank, is_expert

if TYPE_CHECKING:
    from .compact import PlanSet


def resolve_recipes(engines: list[EngineRank]) -> list[EngineRank]:
    """Engine ranks with every recipe filled in: those left to the rules come from the
    model-family rules and the rank's layout. Raises PlanError naming every problem."""
    from .rules import resolve

    out: list[EngineRank] = []
    problems: list[str] = []
    for e in engines:
        if all(t.pieces is not None for t in e.tensors):
            out.append(e)
            continue
        if e.layout is None:
            problems.append(f"engine rank {e.rank} left recipes to the rules but gave no layout")
            continue
        try:
            out.append(replace(e, tensors=resolve(e.tensors, e.layout)))
        except PlanError as exc:
            problems.append(f"engine rank {e.rank}: {exc.message}")
    if problems:
        raise PlanError("\n  ".join(problems))
    return out


def caveats_of(engines: list[EngineRank]) -> list[str]:
    """The rules' caveats (`rules.caveats`) for every engine layout of a job, each once."""
    from .rules import caveats

    out: dict[str, None] = {}
    for e in engines:
        if e.layout is not None and e.layout.model:
            try:
                out.update(dict.fromkeys(caveats(e.layout.model, e.layout)))
            except PlanError:
                continue  # resolving the recipes reports what is wrong with the layout
    return list(out)


def plan(
    job: str,
    trainers: list[TrainerRank],
    engines: list[EngineRank],
    options: PlanOptions | None = None,
    slots: dict[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlanSet:
    """The per-node plans of a job (node -> NodePlan, each made when asked for). Raises
    PlanError naming every problem found.

    `slots` gives each engine rank its immediate counter on its node (unique across the
    jobs a node serves); by default ranks are numbered per node from 0. `progress` is
    told each phase as it starts. (numpy loads here, not with this module: a daemon that
    never coordinates never loads it.)
    """
    from .columnar import build

    trainers = sorted(trainers, key=lambda t: t.rank)
    engines = sorted(engines, key=lambda e: e.rank)
    slots = slots if slots is not None else _slots(engines)
    return build(job, trainers, engines, options or PlanOptions(), slots, progress)


def _slots(engines: list[EngineRank]) -> dict[int, int]:
    per_node: dict[str, int] = defaultdict(int)
    slots: dict[int, int] = {}
    for e in engines:
        slots[e.rank] = per_node[e.node]
        per_node[e.node] += 1
        if slots[e.rank] >= MAX_SLOTS:
            raise PlanError(f"node {e.node} has more than {MAX_SLOTS} engine ranks")
    return slots


__all__ = [
    "ITEMSIZE",
    "EngineRank",
    "PlanOptions",
    "PlanSet",
    "TrainerRank",
    "is_expert",
    "plan",
    "transformed_itemsize",
]
