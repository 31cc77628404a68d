"""The `weightwire` backend through verl's own checkpoint-engine registry and base class
(the installed `verl` package), with real daemons: two actor (trainer) ranks, two rollout
workers (engine replicas), every received tensor checked bitwise."""

from __future__ import annotations

import asyncio
import gc
import re
import warnings
import weakref
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS

# No skip: `make setup` installs verl 0.9.1 (scripts/verl-requirements.txt), so a verl that
# does not import fails here instead of leaving the backend untested.
try:
    with warnings.catch_warnings():
        # verl 0.9.1's own `from ray.experimental.state.api import get_actor`
        warnings.filterwarnings("ignore", "Ray state API is no longer experimental")
        import verl.checkpoint_engine as ce
except ImportError as e:
    raise ImportError(
        f"{e}: verl 0.9.1 does not import; `make setup` installs it and what "
        "verl.checkpoint_engine imports (scripts/verl-requirements.txt)"
    ) from e

pytestmark = pytest.mark.verl

ACTORS, ROLLOUTS = 2, 2


def test_the_installed_verl() -> None:
    """The registry and base class are verl 0.9.x's own (the installed package), and the
    backend leaves none of the base class's abstract methods unimplemented."""
    import importlib.metadata

    from weightwire.adapters.verl import WeightwireCheckpointEngine

    assert importlib.metadata.version("verl").startswith("0.9."), importlib.metadata.version("verl")
    assert ce.CheckpointEngine.__module__ == "verl.checkpoint_engine.base"
    assert ce.CheckpointEngineRegistry.get("weightwire") is WeightwireCheckpointEngine
    assert issubclass(WeightwireCheckpointEngine, ce.CheckpointEngine)
    assert not WeightwireCheckpointEngine.__abstractmethods__


def model(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g),
        "lm_head.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """host0: the actor workers' daemon (coordinator); host1: the rollout workers'."""
    c = LocalCluster(hosts=2, use_netns=NETNS, extra=FAST)
    c.start()
    c.wait_joined()
    yield c
    c.stop()


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_config(**engine_kwargs: Any) -> Any:
    """The README's verl config (its "## verl" yaml block) as verl's own
    CheckpointEngineConfig, through verl's omega_conf_to_dataclass; `engine_kwargs`
    override the documented ones (this test's daemons' sockets)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import CheckpointEngineConfig

    section = README.read_text().split("\n## verl\n", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "README: no yaml block under '## verl'"
    conf = OmegaConf.create(block.group(1)).actor_rollout_ref.rollout.checkpoint_engine
    conf.engine_kwargs.weightwire.update(engine_kwargs)
    return omega_conf_to_dataclass(conf, CheckpointEngineConfig)


def new_engine(**engine_kwargs: Any) -> Any:
    """One backend, made as verl's workers make theirs (engine_workers.py /
    CheckpointEngineWorker): import custom_backend_module, then the registry's `new` with
    the bucket size and engine_kwargs[backend]."""
    from verl.utils.import_utils import import_external_libs

    cfg = readme_config(**engine_kwargs)
    import_external_libs(cfg.custom_backend_module or None)
    return ce.CheckpointEngineRegistry.new(
        cfg.backend,
        bucket_size=cfg.update_weights_bucket_megabytes << 20,
        **cfg.engine_kwargs.get(cfg.backend, {}),
    )


def test_the_documented_config() -> None:
    """The README's config, through verl's config class and registry, makes this backend
    with the documented settings."""
    e = new_engine()
    assert type(e).__name__ == "WeightwireCheckpointEngine"
    assert (e.socket, e.job, e.timeout_s, e.staging_buckets, e.destinations) == (
        "/run/weightwire/weightwired.sock",
        "verl",
        300,
        4,
        "in_place",
    )


def build_process_group(actors: list[Any], rollouts: list[Any]) -> None:
    """What verl's CheckpointEngineManager does before every update: prepare on every
    worker, the backend class's build_topology, init_process_group with each one's share."""
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = type(actors[0]).build_topology(len(actors), len(rollouts), metadata)
    for group, kw in ((actors, actor_kw), (rollouts, rollout_kw)):
        for k, v in kw.items():
            assert len(v) == len(group), k  # verl's manager asserts this too
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})


def backends(c: LocalCluster, job: str, **more: Any) -> tuple[list[Any], list[Any]]:
    """Actor and rollout engines made the way verl makes them (`new_engine`: the README's
    config, verl's registry), their first process group, and the rollout workers'
    receive buffers."""
    cls = ce.CheckpointEngineRegistry.get("weightwire")
    assert issubclass(cls, ce.CheckpointEngine)
    opts = {"job": job, "timeout_s": 60, "destinations": "buffers", **more}
    actors = [new_engine(socket=c.daemons[0].socket, **opts) for _ in range(ACTORS)]
    rollouts = [new_engine(socket=c.daemons[1].socket, **opts) for _ in range(ROLLOUTS)]
    build_process_group(actors, rollouts)
    for r in rollouts:
        r.register_destinations({n: torch.zeros_like(t) for n, t in model(0).items()})
    return actors, rollouts


async def collect(gen: AsyncGenerator[tuple[str, torch.Tensor], None]) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for name, t in gen}


async def step(
    actors: list[Any], rollouts: list[Any], version: int, stream: Any, received: Any = collect
) -> list[Any]:
    """One verl update_weights: the process group built again, send and receive on every
    worker at once, then finalize on every worker. `received(gen)`: what a rollout worker
    does with what receive_weights yields (verl's server adapter loads it)."""
    build_process_group(actors, rollouts)
    out = await asyncio.gather(
        *(a.send_weights(stream(), global_steps=version) for a in actors),
        *(received(r.receive_weights(global_steps=version)) for r in rollouts),
    )
    for e in actors + rollouts:
        e.finalize()
    return out


def check(received: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert received.keys() == want.keys()
    for name, t in want.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


def test_stream_of_named_tensors(cluster: LocalCluster) -> None:
    """verl's stream (full tensors on every actor rank): each rank keeps and sends its share."""
    actors, rollouts = backends(cluster, "verl-stream")
    for version in (1, 2, 3):
        out = asyncio.run(step(actors, rollouts, version, lambda v=version: iter(model(v).items())))
        for received in out[ACTORS:]:
            check(received, model(version))
        assert sum(o["weightwire/bytes"] for o in out[:ACTORS]) > 0
    for e in actors + rollouts:
        e.close()


def test_module_shards_without_the_stream(cluster: LocalCluster) -> None:
    """use_module: the actor ranks publish the module's own parameters; the stream (verl's
    gathers) is never iterated. With `release_parameters`, a parameter offloaded after a
    send (`param.data = ...`, as verl's `model.to("cpu")`) frees its old storage at once,
    and the next send reads it where it is."""
    from weightwire.adapters.verl import use_module

    job = "verl-module"
    module = torch.nn.Module()
    for name, t in model(1).items():
        module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t.clone()))
    use_module(module, rename=lambda n: n.replace("__", "."), job=job)
    held = next(iter(module.parameters()))
    first = np.zeros(held.numel() * held.element_size(), dtype=np.uint8)  # its end is seen
    held.data = torch.from_numpy(first).view(held.dtype).view(held.shape)
    gone = weakref.ref(first)
    del first

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("module mode iterated verl's stream")
        yield  # pragma: no cover

    actors, rollouts = backends(cluster, job, release_parameters=True)
    for version in (1, 2):
        want = model(version)
        with torch.no_grad():
            for name, t in want.items():
                getattr(module, name.replace(".", "__")).copy_(t)
        out = asyncio.run(step(actors, rollouts, version, stream))
        for received in out[ACTORS:]:
            check(received, want)
        held.data = held.detach().clone()  # offloaded and back
        gc.collect()
        assert gone() is None, "the actor holds the storage of an offloaded parameter"
    for e in actors + rollouts:
        e.close()


def test_in_place_destinations(cluster: LocalCluster) -> None:
    """destinations="in_place": engine ranks of their own (as the SGLang plugin registers
    the server's parameters) receive the writes; the rollout worker's receive_weights
    waits until they hold the version and yields nothing for the adapter to load."""
    from weightwire.client import Engine

    job = "verl-in-place"
    params = {n: torch.zeros_like(t) for n, t in model(0).items()}
    server = Engine(
        0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=60, replica=0, replica_size=1
    )
    server.register(params)
    kw = {"job": job, "timeout_s": 60}
    actors = [new_engine(socket=cluster.daemons[0].socket, **kw) for _ in range(ACTORS)]
    rollout = new_engine(socket=cluster.daemons[1].socket, destinations="in_place", **kw)

    async def in_place(gen: AsyncGenerator[tuple[str, torch.Tensor], None]) -> Any:
        """The parameters as they are when receive_weights ends (yielding nothing to load)."""
        assert [name async for name, _ in gen] == []
        return {n: t.clone() for n, t in params.items()}

    for version in (1, 2):
        out = asyncio.run(
            step(actors, [rollout], version, lambda v=version: iter(model(v).items()), in_place)
        )
        check(out[ACTORS], model(version))
    for e in [*actors, rollout]:
        e.close()
    server.close()


def test_a_changed_rollout_group_is_refused(cluster: LocalCluster) -> None:
    """verl's add_replicas / remove_replicas renumber the rollout workers at the next
    update's init_process_group; an engine already registered refuses a new rank or world
    size with a typed error naming both (README, "verl": make new engines then)."""
    from weightwire.protocol.errors import ErrorCode, RegistrationError

    actors, rollouts = backends(cluster, "verl-regroup")
    out = asyncio.run(step(actors, rollouts, 1, lambda: iter(model(1).items())))
    check(out[ACTORS], model(1))
    added = new_engine(socket=cluster.daemons[1].socket, job="verl-regroup", timeout_s=60)
    with pytest.raises(
        RegistrationError, match="engine rank 0 of 2, now asked to be engine rank 0 of 3"
    ) as err:
        build_process_group(actors, [*rollouts, added])
    assert err.value.code == ErrorCode.INVALID
    for e in [*actors, *rollouts, added]:
        e.close()
