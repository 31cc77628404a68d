"""weightwire's SGLang plugin: every TP worker registers its weights with its weightwired.

SGLang 0.5.23 loads general plugins (entry-point group ``sglang.srt.plugins``;
``SGLANG_PLUGINS=weightwire`` restricts to this one) in each of its processes and applies
their hooks (``sglang/srt/plugins/__init__.py::load_plugins``, ``hook_registry.py``).
`register` is the entry point. When ``WEIGHTWIRE_SGLANG`` is ``rules`` or ``replica`` it
adds

- an AFTER hook on ``ModelRunner.load_model``: once the worker's model is loaded (and
  post-processed), `attach` creates ``weightwire.client.Engine(rank, world, ...)`` and
  registers the model's parameters, in place, under SGLang's own names;
- an AFTER hook on ``WeightUpdater.end_weight_update`` (what ``/end_weight_update`` runs in
  the worker): it checks that post-processing kept every registered parameter in its
  registered memory, and raises naming those it moved (writes would miss them);
- with ``--enable-memory-saver``, a BEFORE hook on ``release_memory_occupation`` and an
  AFTER hook on ``resume_memory_occupation`` (the scheduler's weight updater): the daemon
  lets go of the weights before they are released, and maps them again once resumed
  (``Engine.release_gpu_memory`` / ``Engine.resume_gpu_memory``).

Otherwise it does nothing: installing weightwire changes no SGLang server by itself.

Environment of the SGLang server (its workers inherit it):

| variable | meaning |
| --- | --- |
| ``WEIGHTWIRE_SGLANG`` | ``rules`` or ``replica`` (unset or ``off``: the plugin does nothing) |
| ``WEIGHTWIRE_SOCKET`` | the local weightwired's socket (default: the client's) |
| ``WEIGHTWIRE_JOB`` | the weightwire job (default ``default``) |
| ``WEIGHTWIRE_ENGINE_REPLICA`` | this server's engine replica index (default 0) |
| ``WEIGHTWIRE_ENGINE_REPLICAS`` | engine replicas in the job (default 1) |
| ``WEIGHTWIRE_DEST_DTYPE`` | rules mode: EngineLayout.dest_dtype (default: as the config says) |
| ``WEIGHTWIRE_TIMEOUT_S`` | client timeout (default 300) |
| ``WEIGHTWIRE_DAEMON_WAIT_S`` | how long a worker waits for the daemon's socket (default 300) |

Engine rank = replica * tp_size + tp_rank, world = replicas * tp_size; with ``--dp-size D``
(DP attention off) the server holds replicas ``WEIGHTWIRE_ENGINE_REPLICA + dp_rank``, so
give servers replica indices D apart. Rules mode registers with
``EngineLayout(tp_size, tp_rank, ep_size, ep_rank, model=<config.json>)`` and the
coordinator derives every recipe from the model-family rules; replica mode registers
`replica_recipes` under the worker's layout key. Draft workers (speculative decoding) are
left alone. Pipeline parallelism and DP attention are refused: no layout covers them yet.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from .daemonstart import open_engine
from .settings import MODES, Settings

log = logging.getLogger("weightwire.adapters.sglang.plugin")

LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
END_WEIGHT_UPDATE = (
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
    ".end_weight_update"
)
RELEASE_MEMORY = (
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    ".release_memory_occupation"
)
RESUME_MEMORY = (
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    ".resume_memory_occupation"
)
WEIGHTS_TAG = "weights"  # sglang.srt.constants.GPU_MEMORY_TYPE_WEIGHTS


@dataclass
class Binding:
    """A worker's registration: its Engine client and what it registered."""

    engine: Any  # weightwire.client.Engine
    model: Any
    mode: str
    rank: int
    world_size: int
    key: str
    registered: dict[str, tuple[int, tuple[int, ...], Any]]  # name -> (ptr, shape, dtype)

    def moved(self) -> list[str]:
        """Registered parameters that are no longer where they were registered."""
        params = dict(self.model.named_parameters())
        out = []
        for name, (ptr, shape, dtype) in self.registered.items():
            p = params.get(name)
            if p is None or (p.data.data_ptr(), tuple(p.shape), p.dtype) != (ptr, shape, dtype):
                out.append(name)
        return out


_BINDINGS: dict[int, Binding] = {}  # id(model) -> its binding, in this worker process


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: add the hooks when WEIGHTWIRE_SGLANG asks."""
    settings = Settings.from_env()
    if settings.mode == "off":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LOAD_MODEL, after_load_model, HookType.AFTER)
    HookRegistry.register(END_WEIGHT_UPDATE, after_end_weight_update, HookType.AFTER)
    HookRegistry.register(RELEASE_MEMORY, before_release_memory, HookType.BEFORE)
    HookRegistry.register(RESUME_MEMORY, after_resume_memory, HookType.AFTER)


def weights_in(recv_req: Any) -> bool:
    """Whether a release/resume request covers the weights (no tags: every kind)."""
    tags = getattr(recv_req, "tags", None)
    return not tags or WEIGHTS_TAG in tags


def _manager_binding(manager: Any) -> Binding | None:
    worker = getattr(manager, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    return _BINDINGS.get(id(getattr(runner, "model", None)))


def before_release_memory(manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of release_memory_occupation (--enable-memory-saver): the daemon drops
    its mapping of the weights first, so that the release gives their memory back."""
    binding = _manager_binding(manager)
    if binding is not None and weights_in(recv_req):
        binding.engine.release_gpu_memory()
        log.info("weightwire: engine rank %d: weights released", binding.rank)


def after_resume_memory(result: Any, manager: Any, recv_req: Any, *a: Any, **k: Any) -> None:
    """AFTER hook of resume_memory_occupation: the weights are back at the same addresses,
    in new memory; the daemon maps it again (no restart, nothing declared again)."""
    binding = _manager_binding(manager)
    if binding is not None and weights_in(recv_req):
        binding.engine.resume_gpu_memory()
        log.info("weightwire: engine rank %d: weights resumed and registered again", binding.rank)


def after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ModelRunner.load_model(self): `runner` is the ModelRunner."""
    if getattr(runner, "is_draft_worker", False):
        log.info("weightwire: draft worker left alone")
        return
    attach(runner, Settings.from_env())


def after_end_weight_update(result: Any, updater: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of WeightUpdater.end_weight_update(self, run_post_load=...)."""
    binding = _BINDINGS.get(id(updater.get_model()))
    if binding is None:
        return
    moved = binding.moved()
    if moved:
        raise RuntimeError(
            f"weightwire engine rank {binding.rank}: SGLang's post-processing at "
            f"end_weight_update replaced the storage (or shape/dtype) of {len(moved)} "
            f"registered parameters, so further writes would miss them: {', '.join(moved)}"
        )


def binding_of(model: Any) -> Binding | None:
    return _BINDINGS.get(id(model))


def parallel_layout() -> dict[str, int]:
    """This worker's ranks, from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()

    def read(name: str, default: int) -> int:
        try:
            value = getattr(par, name)
        except (AttributeError, RuntimeError, ValueError):
            return default
        return default if value is None else int(value)

    out = {
        "tp_size": read("tp_size", 1),
        "tp_rank": read("tp_rank", 0),
        "ep_size": read("moe_ep_size", 1),
        "ep_rank": read("moe_ep_rank", 0),
        "pp_size": read("pp_size", 1),
        "attn_tp_size": read("attn_tp_size", 0),
        "dp_rank": read("dp_rank", 0),
    }
    if out["attn_tp_size"] == 0:
        out["attn_tp_size"] = out["tp_size"]
    return out


def model_config_dict(runner: Any) -> dict[str, Any]:
    """The HF config the rules read: the model directory's config.json when there is one,
    else the loaded config's to_dict()."""
    mc = runner.model_config
    path = getattr(mc, "model_path", None)
    if isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            cfg: dict[str, Any] = json.load(f)
        return cfg
    raw = mc.hf_config.to_dict()
    return dict(json.loads(json.dumps(raw, default=str)))


def attach(runner: Any, settings: Settings) -> Binding:
    """Create this worker's Engine and register the runner's model parameters."""
    from weightwire.protocol.local import EngineLayout

    from .layout import engine_rank, layout_key, registered_parameters, replica_recipes

    if settings.mode not in MODES:
        raise ValueError(f"weightwire mode {settings.mode!r}: expected one of {MODES}")
    par = parallel_layout()
    if par["pp_size"] != 1:
        raise RuntimeError(
            f"weightwire: pipeline parallelism (pp_size {par['pp_size']}) is not supported"
        )
    if par["attn_tp_size"] != par["tp_size"]:
        raise RuntimeError(
            f"weightwire: DP attention (attention TP {par['attn_tp_size']} of TP "
            f"{par['tp_size']}) is not supported"
        )
    tp, tp_rank, ep = par["tp_size"], par["tp_rank"], par["ep_size"]
    replica = settings.replica + par["dp_rank"]
    if replica >= settings.replicas:
        raise RuntimeError(
            f"weightwire: engine replica {replica} (WEIGHTWIRE_ENGINE_REPLICA "
            f"{settings.replica} + dp rank {par['dp_rank']}) is not below "
            f"WEIGHTWIRE_ENGINE_REPLICAS={settings.replicas}"
        )
    rank, world = engine_rank(replica, tp, tp_rank), settings.replicas * tp
    device = runner.gpu_id if str(getattr(runner, "device", "cpu")).startswith("cuda") else None
    model = runner.model
    params = registered_parameters(model)
    key = layout_key(tp, tp_rank, ep)
    engine = open_engine(settings, rank, world, device, replica=replica, replica_size=tp)
    try:
        if settings.mode == "rules":
            layout = EngineLayout(
                tp_size=tp,
                tp_rank=tp_rank,
                ep_size=ep,
                ep_rank=par["ep_rank"],
                replica=replica,
                model=model_config_dict(runner),
                dest_dtype=settings.dest_dtype,
            )
            engine.register(params, layout=layout)
        else:
            layout = EngineLayout(
                tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=par["ep_rank"], replica=replica
            )
            engine.register(params, replica_recipes(params, key), layout=layout)
    except BaseException:
        engine.close()
        raise
    binding = Binding(
        engine=engine,
        model=model,
        mode=settings.mode,
        rank=rank,
        world_size=world,
        key=key,
        registered={n: (p.data.data_ptr(), tuple(p.shape), p.dtype) for n, p in params.items()},
    )
    _BINDINGS[id(model)] = binding
    runner.weightwire = binding
    engine.on_version(lambda event: _log_version(binding, event))
    log.info(
        "weightwire: engine rank %d/%d (%s, %s mode, job %s) registered %d parameters",
        rank,
        world,
        key,
        settings.mode,
        settings.job,
        len(params),
    )
    return binding


def detach(model: Any) -> None:
    """Close a worker's Engine (tests; a server process just exits)."""
    binding = _BINDINGS.pop(id(model), None)
    if binding is not None:
        binding.engine.close()


def _log_version(binding: Binding, event: Any) -> None:
    if isinstance(event, Exception):
        log.warning("weightwire: engine rank %d: %s", binding.rank, event)
    else:
        log.info(
            "weightwire: engine rank %d: version %d landed (%d bytes, %.3f s)",
            binding.rank,
            event.version,
            event.nbytes,
            event.seconds,
        )
