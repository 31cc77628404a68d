"""Build SGLang's real model classes on CPU at a chosen TP/EP rank, without a GPU and
without torch.distributed, and load HF-named tensors through the model's own
``load_weights`` (SGLang 0.5.23; scripts/SGLANG_NOTES.md records how and why).

Importing this module, before anything imports sglang:

- sets ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU platform and CPU branches in layers);
- serves stand-in modules for ``sgl_kernel`` and ``torchvision`` where they are not
  installed (``sgl_kernel`` has no CPU wheel; PyPI's torchvision does not match a CPU
  torch). Every attribute of a stand-in is a callable that raises when called: model
  construction and ``load_weights`` of the supported families never call them.
  ``install_standins(roots)`` forces more.

The environment variable is inherited by child processes: do not import this module in a
process that then launches SGLang servers for a GPU. It refuses to load after sglang was
imported without it, since SGLang picks its platform at import.

Topology: ``publish_topology`` publishes ``ServerArgs(device="cpu", tp_size, ep_size)``
for one rank through ``sglang.srt.runtime_context`` and replaces every parallel group by a
`FakeGroup` (world size and rank only; collectives raise). Publishing is
last-publish-wins per process, so `republish(model)` restores a built model's topology
before it loads again.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

if "sglang" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    raise ImportError(
        "weightwire.adapters.sglang.cpu must be imported before sglang (it sets "
        "SGLANG_USE_CPU_ENGINE=1, which SGLang reads when it picks its platform at import)"
    )
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"

import torch

STANDIN_ROOTS = ("sgl_kernel", "torchvision")


# --------------------------------------------------------------------------- stand-ins
class _Missing:
    """Any attribute of a stand-in module: importable, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"stand-in {self._name} was called (no real kernel on this machine)")

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        name = module.__name__
        # A parseable version: transformers asks torchvision's version when it is
        # importable; no __file__, so it is not taken for a real install.
        module.__version__ = "0.0.0+standin"

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Missing(f"{name}.{attr}")

        module.__getattr__ = __getattr__


class _StandinFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.roots: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)
        return None


def _finder() -> _StandinFinder:
    for f in sys.meta_path:
        if isinstance(f, _StandinFinder):
            return f
    f = _StandinFinder()
    sys.meta_path.insert(0, f)
    return f


def install_standins(roots: Iterable[str] | None = None) -> set[str]:
    """Serve stand-ins for `roots` (default: those of STANDIN_ROOTS that are not
    installed). Returns every root now stood in."""
    finder = _finder()
    if roots is None:
        roots = [
            r for r in STANDIN_ROOTS if r in finder.roots or importlib.util.find_spec(r) is None
        ]
    finder.roots |= set(roots)
    return set(finder.roots)


install_standins()

# Quiet SGLang's import-time chatter unless asked for.
if not os.environ.get("SGLANG_CPU_VERBOSE"):
    logging.getLogger("sglang").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- groups
class FakeGroup:
    """Stands in for sglang's GroupCoordinator: world size and rank only.

    Model construction and load_weights read ``world_size``/``rank_in_group``
    (and the PP flags); any collective raises.
    """

    def __init__(self, name: str, world_size: int, rank_in_group: int) -> None:
        self.unique_name = name
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.rank = rank_in_group
        self.local_rank = rank_in_group
        self.ranks = list(range(world_size))
        self.first_rank = 0
        self.last_rank = world_size - 1
        self.is_first_rank = rank_in_group == 0
        self.is_last_rank = rank_in_group == world_size - 1
        self.next_rank = (rank_in_group + 1) % world_size
        self.prev_rank = (rank_in_group - 1) % world_size
        self.device_group = None
        self.cpu_group = None
        self.device = torch.device("cpu")
        self.use_pynccl = False
        self.pynccl_comm = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def _no_collective(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"FakeGroup({self.unique_name}).{name}: no collectives on CPU")

        return _no_collective

    def __repr__(self) -> str:
        return f"FakeGroup({self.unique_name}, rank {self.rank_in_group}/{self.world_size})"


# --------------------------------------------------------------------------- topology
@contextlib.contextmanager
def config_dir(hf_config: dict[str, Any]) -> Iterator[str]:
    """A temporary model directory holding `hf_config` as config.json (SGLang reads the
    HF config from a model path)."""
    with tempfile.TemporaryDirectory(prefix="sglang-cpu-cfg-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config, f)
        yield model_dir


def publish_topology(
    model_dir: str,
    tp_size: int,
    tp_rank: int,
    ep_size: int = 1,
    dtype: str = "bfloat16",
    **server_args: Any,
) -> Any:
    """Publish ServerArgs(device="cpu", tp_size, ep_size) for WORLD rank ``tp_rank``
    and replace every parallel group by a FakeGroup of the right width/rank."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=tp_size,
        ep_size=ep_size,
        dtype=dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        **server_args,
    )
    reset_context()
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
    par = get_parallel()
    groups = {
        "world_group": FakeGroup("world", tp_size, tp_rank),
        "tp_group": FakeGroup("tp", par.tp_size, par.tp_rank),
        "attn_tp_group": FakeGroup("attn_tp", par.attn_tp_size, par.attn_tp_rank),
        "attn_cp_group": FakeGroup("attn_cp", par.attn_cp_size, par.attn_cp_rank),
        "pp_group": FakeGroup("pp", 1, 0),
        "moe_ep_group": FakeGroup("moe_ep", par.moe_ep_size, par.moe_ep_rank),
        "moe_tp_group": FakeGroup("moe_tp", par.moe_tp_size, par.moe_tp_rank),
        "moe_dp_group": FakeGroup("moe_dp", par.moe_dp_size, par.moe_dp_rank),
    }
    par.override_permanently(**groups)
    return args


def republish(model: torch.nn.Module) -> None:
    """Publish again the topology `model` was built with (another build in this process
    may have replaced it), so that its `load_weights` sees its own ranks."""
    built = getattr(model, "_weightwire_cpu_build", None)
    if built is None:
        raise ValueError("this model was not built by weightwire.adapters.sglang.cpu")
    hf_config, tp_size, tp_rank, ep_size, dtype_name, server_args = built
    with config_dir(hf_config) as model_dir:
        publish_topology(model_dir, tp_size, tp_rank, ep_size, dtype_name, **server_args)


# --------------------------------------------------------------------------- build / load
def build_model(
    hf_config: dict[str, Any],
    tp_size: int,
    tp_rank: int,
    ep_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    **server_args: Any,
) -> torch.nn.Module:
    """Build the real SGLang model class for ``hf_config["architectures"][0]`` as
    TP rank ``tp_rank`` of ``tp_size`` (experts over ``ep_size``), on CPU, with
    uninitialised (torch.empty) parameters. Same path as sglang's
    DummyModelLoader.load_model minus the random init and post-processing."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    dtype_name = str(dtype).removeprefix("torch.")
    with config_dir(hf_config) as model_dir:
        publish_topology(model_dir, tp_size, tp_rank, ep_size, dtype_name, **server_args)
        model_config = ModelConfig(model_path=model_dir, dtype=dtype_name)
        load_config = LoadConfig(load_format="dummy")
        quant_config = _get_quantization_config(model_config, load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, quant_config)
    model.sglang_cpu_topology = {"tp_size": tp_size, "tp_rank": tp_rank, "ep_size": ep_size}
    model._weightwire_cpu_build = (
        dict(hf_config),
        tp_size,
        tp_rank,
        ep_size,
        dtype_name,
        dict(server_args),
    )
    return model.eval()


def load_hf_weights(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    postprocess: bool = False,
) -> None:
    """Feed HF-named full tensors to the model's own ``load_weights``; each
    parameter's weight_loader keeps this rank's shard. ``postprocess`` also runs
    every quant method's process_weights_after_loading, as DefaultModelLoader does
    (on CPU that may repack weights for CPU kernels: off by default)."""
    with torch.no_grad():
        model.load_weights(iter(named_tensors))
        if postprocess:
            from sglang.srt.model_loader.loader import DefaultModelLoader

            DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def engine_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, names as SGLang has them (params first)."""
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        yield name, p.data
        seen.add(id(p))
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            yield name, b


def extra_tensor_attrs(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain tensor attributes on modules that are neither parameters nor buffers
    (e.g. MLA's derived w_kc / w_vc)."""
    for mname, mod in model.named_modules():
        known = set(dict(mod.named_parameters(recurse=False))) | set(
            dict(mod.named_buffers(recurse=False))
        )
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and k not in known and not k.startswith("_"):
                yield (f"{mname}.{k}" if mname else k), v
