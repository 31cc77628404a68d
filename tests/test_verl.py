"""The `weightwire` backend through verl's own checkpoint-engine registry and base class
(the installed `verl` package), with real daemons: two actor (trainer) ranks, two rollout
workers (engine replicas), every received tensor checked bitwise."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
import torch

from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS

ce = pytest.importorskip(
    "verl.checkpoint_engine",
    reason="verl is not installed (pip install --no-deps verl==0.9.1 and the deps of "
    "verl.checkpoint_engine: README, 'verl')",
)
pytestmark = pytest.mark.verl

ACTORS, ROLLOUTS = 2, 2


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


def backends(c: LocalCluster, job: str) -> tuple[list[Any], list[Any]]:
    """Actor and rollout engines made the way verl makes them: by the registry, from the
    backend name and engine_kwargs, then prepare / build_topology / init_process_group."""
    import weightwire.adapters.verl  # noqa: F401  (custom_backend_module: registers it)

    cls = ce.CheckpointEngineRegistry.get("weightwire")
    assert issubclass(cls, ce.CheckpointEngine)
    actors = [
        ce.CheckpointEngineRegistry.new(
            "weightwire", bucket_size=1 << 20, socket=c.daemons[0].socket, job=job, timeout_s=60
        )
        for _ in range(ACTORS)
    ]
    rollouts = [
        ce.CheckpointEngineRegistry.new(
            "weightwire", bucket_size=1 << 20, socket=c.daemons[1].socket, job=job, timeout_s=60
        )
        for _ in range(ROLLOUTS)
    ]
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = cls.build_topology(ACTORS, ROLLOUTS, metadata)
    for group, kw in ((actors, actor_kw), (rollouts, rollout_kw)):
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})
    for r in rollouts:
        r.register_destinations({n: torch.zeros_like(t) for n, t in model(0).items()})
    return actors, rollouts


async def collect(gen: AsyncGenerator[tuple[str, torch.Tensor], None]) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for name, t in gen}


async def step(actors: list[Any], rollouts: list[Any], version: int, stream: Any) -> list[Any]:
    return await asyncio.gather(
        *(a.send_weights(stream(), global_steps=version) for a in actors),
        *(collect(r.receive_weights(global_steps=version)) for r in rollouts),
    )


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
        e.finalize()
        e.close()


def test_module_shards_without_the_stream(cluster: LocalCluster) -> None:
    """use_module: the actor ranks publish the module's own parameters; the stream (verl's
    gathers) is never iterated."""
    from weightwire.adapters.verl import use_module

    job = "verl-module"
    module = torch.nn.Module()
    for name, t in model(1).items():
        module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t.clone()))
    use_module(module, rename=lambda n: n.replace("__", "."), job=job)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("module mode iterated verl's stream")
        yield  # pragma: no cover

    actors, rollouts = backends(cluster, job)
    for version in (1, 2):
        want = model(version)
        with torch.no_grad():
            for name, t in want.items():
                getattr(module, name.replace(".", "__")).copy_(t)
        out = asyncio.run(step(actors, rollouts, version, stream))
        for received in out[ACTORS:]:
            check(received, want)
    for e in actors + rollouts:
        e.close()


def test_in_place_destinations(cluster: LocalCluster) -> None:
    """destinations="in_place": engine ranks of their own (as the SGLang plugin registers
    the server's parameters) receive the writes; the rollout worker's receive_weights
    waits until they hold the version and yields nothing for the adapter to load."""
    import weightwire.adapters.verl  # noqa: F401
    from weightwire.client import Engine

    job = "verl-in-place"
    params = {n: torch.zeros_like(t) for n, t in model(0).items()}
    server = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, replica=0, replica_size=1)
    server.register(params)
    actors = [
        ce.CheckpointEngineRegistry.new(
            "weightwire", bucket_size=1 << 20, socket=cluster.daemons[0].socket, job=job
        )
        for _ in range(ACTORS)
    ]
    rollout = ce.CheckpointEngineRegistry.new(
        "weightwire",
        bucket_size=1 << 20,
        socket=cluster.daemons[1].socket,
        job=job,
        destinations="in_place",
    )
    actor_kw, rollout_kw = type(rollout).build_topology(ACTORS, 1, [])
    for i, a in enumerate(actors):
        a.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
    rollout.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})
    for version in (1, 2):
        out = asyncio.run(
            step(actors, [rollout], version, lambda v=version: iter(model(v).items()))
        )
        assert out[ACTORS] == {}  # nothing to load: the bytes are in the parameters
        check(params, model(version))
    for e in [*actors, rollout]:
        e.close()
    server.close()
