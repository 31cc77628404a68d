"""How many layers a `weightwire bench gpu` run uses, and which GPU each rank is on."""

from __future__ import annotations

from typing import Any

from . import model as M
from .errors import RunError


def fit_layers(
    cfg: dict[str, Any],
    args: Any,
    trainers: int,
    engines: int,
    budget: int | None,
    host_budget: int | None = None,
) -> tuple[int, str]:
    """The layers to run: --layers N (`auto`: the config's), or fewer when the estimated
    peak of a rank on its GPU (or the CPU replica in /dev/shm) would not fit."""
    given = args.layers != "auto"
    layers = int(args.layers) if given else int(cfg["num_hidden_layers"])
    source = "--layers" if given else "the config's"
    if budget is None and host_budget is None:
        return layers, source
    full = args.trainer_layout == "full"

    def fits(n: int) -> bool:
        s = M.sizes({**cfg, "num_hidden_layers": n}, engines, args.dest)
        t, e = M.peak_bytes(
            s,
            trainers,
            engines,
            full,
            args.bucket_mb << 20,
            not args.no_baseline and not args.replica,
        )
        if budget is not None and max(t, e) > budget:
            return False
        return host_budget is None or sum(s.engine_bytes) <= host_budget

    if fits(layers):
        return layers, f"{source}, fits"
    lo, hi = 0, layers  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        where = "the GPU memory" if host_budget is None else "the GPU memory or /dev/shm"
        raise RunError(f"not even one layer of this model fits {where}")
    return lo, f"reduced from {layers} ({source}): the estimated peak of {layers} does not fit"


def placement(text: str, trainers: int, engines: int, n: int) -> tuple[list[int], list[int]]:
    """--place "0,0:1,1": the trainer ranks' GPUs, a colon, the engine ranks' GPUs."""
    try:
        t_text, e_text = text.split(":")
        tg = [int(x) for x in t_text.split(",")]
        eg = [int(x) for x in e_text.split(",")]
    except ValueError:
        raise SystemExit(
            f"--place {text!r}: expected trainer GPUs:engine GPUs, e.g. 0,0:1,1"
        ) from None
    if len(tg) != trainers or len(eg) != engines or not all(0 <= g < n for g in tg + eg):
        raise SystemExit(
            f"--place {text!r}: needs {trainers} trainer and {engines} engine GPU ordinals "
            f"below {n}"
        )
    return tg, eg
