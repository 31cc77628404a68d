"""Names shared by both sides of replica mode, and what an SGLang worker registers.

A *layout key* names one engine parallel layout: ``tp{rank}of{size}``, plus ``-ep{size}``
with expert parallelism (the EP rank follows from the TP rank in SGLang:
``moe_ep_rank = tp_rank // (tp_size / ep_size)``). Every engine replica's TP rank r has
the same layout, so all of them read one trainer-side replica: the sources of layout k
are named ``{key}/{SGLang parameter name}`` (several replicas live on one trainer rank
without clashing), and an engine rank's recipe for parameter ``n`` is the whole source
``{key}/n``.

Which trainer rank builds which replica: layout k (the TP rank) on trainer rank
``k mod N``, N trainer ranks holding replicas (`layouts_of`); with N > tp_size only tp_size
trainer ranks hold one, and the weightwire trainer world is those ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightwire.client import Recipe
from weightwire.protocol.tensors import Box, Piece

# Parameters SGLang sets itself, never from a checkpoint: FP8 attention's KV-cache scales
# (1.0 unless the checkpoint has some, which block-FP8 ones do not). Neither mode sends them.
NOT_FROM_CHECKPOINT = (".k_scale", ".v_scale")


def layout_key(tp_size: int, tp_rank: int, ep_size: int = 1) -> str:
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} outside 0..{tp_size - 1}")
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep size {ep_size} does not divide tp size {tp_size}")
    return f"tp{tp_rank}of{tp_size}" + (f"-ep{ep_size}" if ep_size > 1 else "")


def source_name(key: str, name: str) -> str:
    """The trainer-side name of replica parameter `name` of layout `key`."""
    return f"{key}/{name}"


def layouts_of(trainer_rank: int, trainer_world: int, tp_size: int) -> list[int]:
    """The TP ranks (layouts) whose replica trainer rank `trainer_rank` of `trainer_world`
    holds: k mod trainer_world == trainer_rank."""
    if not 0 <= trainer_rank < trainer_world:
        raise ValueError(f"trainer rank {trainer_rank} outside 0..{trainer_world - 1}")
    return [k for k in range(tp_size) if k % trainer_world == trainer_rank]


def engine_rank(replica: int, tp_size: int, tp_rank: int) -> int:
    """The weightwire engine rank of TP rank `tp_rank` of engine replica `replica`."""
    return replica * tp_size + tp_rank


def registered_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """What a worker registers, and what a replica publishes: every parameter under the
    name SGLang gives it (tied ones once), except those SGLang sets itself. Buffers
    (rotary caches) and plain tensor attributes (MLA's w_kc/w_vc) are derived by the
    engine and never sent."""
    return {n: p for n, p in model.named_parameters() if not n.endswith(NOT_FROM_CHECKPOINT)}


def replica_recipes(named_params: Mapping[str, torch.Tensor], key: str) -> dict[str, Recipe]:
    """Replica mode, engine side: parameter `n` is the whole source `{key}/n`, byte for byte.

    `key` is the engine rank's layout key (`layout_key`); the planner checks that the
    trainer-side replica of that layout holds each name with the same dtype and shape.
    """
    return {
        n: Recipe((Piece(source=source_name(key, n), box=Box.full(tuple(t.shape)), dst_offset=0),))
        for n, t in named_params.items()
    }
