"""Routed experts (FusedMoE), shared by Qwen3-MoE and DeepSeek-V3 / Kimi-K2.

SGLang 0.5.23, engine rank r of tp with ep expert-parallel groups: moe_tp = tp/ep,
moe_tp_rank = r % moe_tp, EP rank k = r // moe_tp holds experts [k·E/ep, (k+1)·E/ep)
(contiguous: `FusedMoE._map_global_expert_id_to_local_expert_id` without expert-location
metadata, i.e. no EPLB / redundant experts):

- `experts.w13_weight` [E/ep, 2·I/moe_tp, H]: per local expert [gate rows; up rows] of
  this moe_tp rank ("w1" then "w3").
- `experts.w2_weight` [E/ep, H, I/moe_tp]: per local expert the down_proj columns.
- FP8: `w13_weight_scale_inv` [E/ep, 2·I/moe_tp/128, H/128] and `w2_weight_scale_inv`
  [E/ep, H/128, I/moe_tp/128], the block scales sliced like the weights.
"""

from __future__ import annotations

from collections.abc import Callable

from weightwire.protocol.errors import PlanError

from .common import Ctx, Seg, split


def hf_experts(p: str, n: int, inter: int, hidden: int, add: Callable[..., None]) -> None:
    for e in range(n):
        x = f"{p}.{e}"
        add(f"{x}.gate_proj.weight", inter, hidden)
        add(f"{x}.up_proj.weight", inter, hidden)
        add(f"{x}.down_proj.weight", hidden, inter)


def experts(ctx: Ctx, p: str, n: int) -> None:
    """`{p}.w13_weight`, `{p}.w2_weight` (and FP8 scales) from HF `{p}.{e}.*_proj.weight`."""
    if n % ctx.ep:
        raise PlanError(f"{p}: {n} experts do not divide over ep_size {ctx.ep}")
    if ctx.moe_tp > n:
        raise PlanError(f"{p}: moe tp {ctx.moe_tp} is greater than the number of experts {n}")
    local = n // ctx.ep
    first = ctx.moe_ep_rank * local
    inter = ctx.shape(f"{p}.{first}.gate_proj.weight")[0]
    lo, hi = split(inter, ctx.moe_tp, ctx.moe_tp_rank, f"{p} moe_intermediate_size")
    w13: list[list[Seg]] = []
    w2: list[list[Seg]] = []
    for e in range(first, first + local):
        x = f"{p}.{e}"
        w13.append(
            [ctx.rows(f"{x}.gate_proj.weight", lo, hi), ctx.rows(f"{x}.up_proj.weight", lo, hi)]
        )
        w2.append([ctx.cols(f"{x}.down_proj.weight", lo, hi)])
    ctx.matrix(f"{p}.w13_weight", w13, stacked=True)
    ctx.matrix(f"{p}.w2_weight", w2, stacked=True)
