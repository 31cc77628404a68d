"""Replica mode, trainer side: SGLang's own model class on CPU, in an engine rank's layout,
as the trainer rank's zero-copy sources (the approach LMSYS published for SGLang + miles).

For each engine layout it holds (TP rank k of the engine, on trainer rank k mod N), a
trainer rank builds SGLang's real model class on CPU as that rank, then moves every
parameter, in place, into memory from `Trainer.allocate` (a region per layout, registered
with the daemon once, and pinned for CUDA when a GPU is there). The model's own `load_weights`
therefore writes each version straight into the registered region, and `publish` sends
from there untouched: no packing, no staging. Each parameter is a source named
``{layout key}/{SGLang name}``; engine ranks of that layout (every engine replica's TP
rank k) read the whole source of the same name (`layout.replica_recipes`), so the plan is
one to one by name and works for any model SGLang can build, not only those the
model-family rules know.

    tr = Trainer(rank, world_size=min(N, tp), socket=...)
    rep = SGLangReplica(tr, hf_config, tp_size=2)       # builds, allocates, registers
    tr.prepare()
    for step in ...:
        rep.publish(step, hf_named_full_tensors)        # load_weights, then publish

What the replica holds is what `load_weights` writes: the checkpoint-layout shards of
every parameter. What it does not cover, and who does:

- Derived tensors: MLA's ``w_kc``/``w_vc`` (and FP8 ``w_scale``) are plain attributes
  made by ``post_load_weights``; rotary caches are buffers. None is sent. The replica skips
  ``post_load_weights`` (as miles does); the engine rebuilds them in
  ``/end_weight_update`` (SGLang runs ``post_load_weights`` there when no
  ``load_weights`` ran in the session, which is the case for writes from outside).
- Post-processing: ``process_weights_after_loading`` (FP8 requantization/repacking,
  MoE backend permutations) runs on the engine at ``/end_weight_update``, after
  ``/begin_weight_update`` restored the loadable layout. The replica never runs it.
  A method that replaces a parameter's storage instead of writing into it breaks the
  registration; the worker plugin checks after every ``end_weight_update`` and says which.
- FP8 engines: the replica is built from the same config, so it has FP8 parameters, and
  ``load_weights`` expects an FP8 checkpoint (codes + ``weight_scale_inv``): quantize
  before `publish` (or use rules mode, whose senders quantize).
- The replica must be built with the engine's server arguments where they change the
  layout (e.g. ``enforce_shared_experts_fusion=True`` for a CUDA DeepSeek-V3 engine that
  fuses its shared expert): pass them as keyword arguments. The planner refuses a
  replica whose names, dtypes or shapes differ from the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.client import PublishStats, Trainer
from weightwire.protocol.errors import ErrorCode, RegistrationError

from . import cpu
from .layout import layout_key, layouts_of, registered_parameters, source_name

log = logging.getLogger("weightwire.adapters.sglang.replica")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class ReplicaLayout:
    """One engine layout's replica: the SGLang model and its parameters as sources."""

    key: str
    tp_size: int
    tp_rank: int
    ep_size: int
    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]  # SGLang name -> parameter (in the region)
    sources: dict[str, torch.Tensor]  # source name -> the same memory

    def moved(self) -> list[str]:
        """Parameters whose storage is no longer the registered memory."""
        out = []
        for name, p in self.params.items():
            src = self.sources[source_name(self.key, name)]
            if p.data.data_ptr() != src.data_ptr() or p.data.shape != src.shape:
                out.append(name)
        return out


class SGLangReplica:
    """The CPU replicas of one trainer rank, registered once, published zero-copy.

    `tp_ranks`: the engine TP ranks (layouts) this trainer rank holds; by default layout k
    on trainer rank k mod `trainer.world_size`. `dtype` and `server_args` must be the
    engine's. `pin`: register the region with CUDA (cudaHostRegister) so that loading from
    GPU tensors copies at pinned speed; None = when CUDA is available.
    `post_load`: let the model's `load_weights` run its `post_load_weights` (derived
    tensors, never sent; off by default, they are the engine's to rebuild).
    """

    def __init__(
        self,
        trainer: Trainer,
        hf_config: Mapping[str, Any],
        *,
        tp_size: int,
        ep_size: int = 1,
        tp_ranks: Sequence[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        pin: bool | None = None,
        post_load: bool = False,
        **server_args: Any,
    ) -> None:
        self.trainer = trainer
        ranks = (
            layouts_of(trainer.rank, trainer.world_size, tp_size)
            if tp_ranks is None
            else list(tp_ranks)
        )
        if not ranks:
            raise RegistrationError(
                f"trainer rank {trainer.rank} of {trainer.world_size} holds no replica of a "
                f"TP-{tp_size} engine (layout k lives on trainer rank k mod N): make the "
                f"weightwire trainer world the ranks that hold one (at most {tp_size})",
                code=ErrorCode.INVALID,
            )
        _warn_caveats(hf_config, tp_size, ep_size)
        self.layouts: list[ReplicaLayout] = []
        self._pinned: list[int] = []
        self._checked = False
        for r in ranks:  # one layout at a time: its build memory is freed before the next
            self.layouts.append(
                self._build(r, dict(hf_config), tp_size, ep_size, dtype, post_load, server_args)
            )
            if pin or pin is None:
                base = _pin(list(self.layouts[-1].sources.values()))
                if base is not None:
                    self._pinned.append(base)
        trainer.register({n: t for lay in self.layouts for n, t in lay.sources.items()})
        log.info(
            "replica ready: layouts %s, %d tensors, %.1f MiB%s",
            [lay.key for lay in self.layouts],
            sum(len(lay.sources) for lay in self.layouts),
            self.nbytes / 2**20,
            ", pinned" if self._pinned else "",
        )

    def _build(
        self,
        tp_rank: int,
        hf_config: dict[str, Any],
        tp_size: int,
        ep_size: int,
        dtype: torch.dtype,
        post_load: bool,
        server_args: dict[str, Any],
    ) -> ReplicaLayout:
        """SGLang's model class as engine TP rank `tp_rank`, its parameters moved into a
        region from `Trainer.allocate` (filled with NaN: what load_weights never writes
        is caught at the first publish)."""
        model = cpu.build_model(hf_config, tp_size, tp_rank, ep_size, dtype, **server_args)
        if not post_load and hasattr(model, "post_load_weights"):
            model.post_load_weights = _skip_post_load
        key = layout_key(tp_size, tp_rank, ep_size)
        params = registered_parameters(model)
        memory = self.trainer.allocate(
            {source_name(key, n): (tuple(p.shape), p.dtype) for n, p in params.items()}
        )
        with torch.no_grad():
            for name, p in params.items():
                view = memory[source_name(key, name)]
                if p.is_floating_point():
                    view.fill_(float("nan"))
                else:
                    view.copy_(p.data)
                p.data = view
        return ReplicaLayout(
            key=key,
            tp_size=tp_size,
            tp_rank=tp_rank,
            ep_size=ep_size,
            model=model,
            params=params,
            sources=memory,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for lay in self.layouts for t in lay.sources.values())

    def load(self, named_tensors: NamedTensors) -> None:
        """Feed HF-named full tensors (all, or one bucket of them) to every replica's own
        `load_weights`, which writes this rank's shards into the registered memory. GPU
        tensors are copied to the replica by the loaders. Not while a publish runs."""
        items: Iterable[tuple[str, torch.Tensor]]
        if isinstance(named_tensors, Mapping):
            items = named_tensors.items()
        elif len(self.layouts) > 1 and not isinstance(named_tensors, list | tuple):
            items = list(named_tensors)  # every replica reads them
        else:
            items = named_tensors
        for lay in self.layouts:
            cpu.republish(lay.model)  # its loaders see its own ranks
            with torch.no_grad():
                lay.model.load_weights(iter(items))
            moved = lay.moved()
            if moved:
                raise RegistrationError(
                    f"SGLang's load_weights replaced the storage of {len(moved)} parameters "
                    f"of replica {lay.key} instead of writing into it: {', '.join(moved)}",
                    code=ErrorCode.INVALID,
                )

    def publish(self, version: int, named_tensors: NamedTensors | None = None) -> PublishStats:
        """`load(named_tensors)` when given, then publish `version` from the replicas.

        The first publish checks that `load_weights` wrote every parameter (SGLang's
        loaders skip names they cannot place with only a log line).
        """
        if named_tensors is not None:
            self.load(named_tensors)
        if not self._checked:
            self.check_loaded()
        return self.trainer.publish(version)

    def check_loaded(self) -> None:
        """Raise naming every replica parameter `load_weights` left (partly) unwritten."""
        missing = [
            f"{lay.key}/{name}"
            for lay in self.layouts
            for name, p in lay.params.items()
            if p.is_floating_point() and bool(torch.isnan(p.data).any())
        ]
        if missing:
            raise RegistrationError(
                f"{len(missing)} replica parameters were never (or only partly) written by "
                f"SGLang's load_weights: were their HF tensors in what was loaded? "
                + ", ".join(missing),
                code=ErrorCode.UNKNOWN_TENSOR,
            )
        self._checked = True

    def close(self) -> None:
        """Unpin (the regions themselves are the trainer's, freed by `trainer.close()`)."""
        for base in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(base)
        self._pinned.clear()


def _skip_post_load(*args: Any, **kwargs: Any) -> None:
    """The replica's `post_load_weights`: derived tensors are the engine's to make."""


def _pin(tensors: list[torch.Tensor]) -> int | None:
    """cudaHostRegister the span of `tensors` (one allocated region); its base, or None."""
    if not tensors or not torch.cuda.is_available():
        return None
    base = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.nbytes for t in tensors)
    rc = torch.cuda.cudart().cudaHostRegister(base, end - base, 0)
    if int(rc) != 0:
        log.warning(
            "cudaHostRegister of the replica (%.1f MiB) failed (%s): loads from GPU tensors "
            "copy at pageable speed",
            (end - base) / 2**20,
            rc,
        )
        return None
    return base


def _warn_caveats(hf_config: Mapping[str, Any], tp_size: int, ep_size: int) -> None:
    """The rules' plan-time caveats for this model, said where a replica is built: its
    engines declare explicit recipes, so the coordinator cannot see the model."""
    from weightwire.plan.rules import caveats
    from weightwire.protocol.errors import PlanError
    from weightwire.protocol.local import EngineLayout

    layout = EngineLayout(tp_size=tp_size, ep_size=ep_size, model=dict(hf_config))  # type: ignore[arg-type]
    try:
        found = caveats(hf_config, layout)
    except PlanError:
        return  # a model the rules do not cover: nothing known about it
    for caveat in found:
        log.warning("replica of %s: %s", hf_config.get("model_type", "?"), caveat)
