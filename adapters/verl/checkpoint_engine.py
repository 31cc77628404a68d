"""The `weightwire` checkpoint engine for verl 0.9.x.

verl moves weights as a stream of full named tensors: the actor's `get_per_tensor_param()`
gathers every tensor (FSDP all-gathers) on every actor rank, `send_weights` consumes it,
and the rollout side's `receive_weights` yields named tensors that the server adapter loads
into the engine. This backend maps that API onto weightwire's point-to-point writes:

Trainer side (actor workers, role "trainer"):
- module mode (`use_module(model)` before the first update): the rank registers its own
  parameter shards once (`Trainer.register_module`: FSDP2 DTensors as they are) and each
  `send_weights` publishes them; the stream is never iterated, so nothing is gathered.
- stream mode (the default): every rank iterates the stream (its gathers are collectives)
  and keeps only tensors i with i % world_size == rank, copied into memory from
  `Trainer.allocate` (registered once, sent zero-copy). That costs one host copy of 1/N of
  the model per rank and the gathers verl does anyway; the writes are still point to point.

Rollout side (checkpoint-engine workers, role "engine"), each rollout worker one engine
replica of one rank (elastic: a replica that dies or joins does not stop the others):
- in-place mode (`destinations="in_place"`): the SGLang plugin (WEIGHTWIRE_SGLANG) has
  registered the engine's parameters in place in the TP workers; `receive_weights` waits
  until this node's engine ranks of the job hold the version and yields nothing (no load).
- buffers mode (`register_destinations(tensors)`): the worker registers receive tensors of
  its own; `receive_weights` waits for the version and yields them by name for the server
  adapter to load (one local copy, as verl's other backends yield their buckets).
"""

from __future__ import annotations

import asyncio
import os
import socket as socket_mod
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightwire.client import Engine, Trainer
from weightwire.protocol.errors import ErrorCode, RegistrationError, TimeoutError_

Rename = Callable[[str], str | None]

_MODULES: dict[str, tuple[torch.nn.Module, Rename | None]] = {}


def use_module(module: torch.nn.Module, rename: Rename | None = None, *, job: str = "verl") -> None:
    """Trainer side, in the actor worker's process: publish `module`'s own shards (module
    mode) instead of the full tensors of verl's stream. `rename` maps parameter names to
    HF names (return None to leave one out), as in `Trainer.register_module`."""
    _MODULES[job] = (module, rename)


@CheckpointEngineRegistry.register("weightwire")
class WeightwireCheckpointEngine(CheckpointEngine):
    """verl's `engine_kwargs.weightwire` are this constructor's keyword arguments:
    `socket` (the local weightwired's; default WEIGHTWIRE_SOCKET or its default path),
    `job` ("verl"), `timeout_s`, `staging_buckets` (trainer ring slots), `destinations`
    ("buffers" or "in_place") and `release_parameters` (module mode: after each send the
    rank holds none of the module's parameter storage, so that verl's param offload frees
    it; `Trainer.release_parameters`)."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        socket: str | None = None,
        job: str = "verl",
        timeout_s: float = 300.0,
        staging_buckets: int = 4,
        destinations: str = "buffers",
        release_parameters: bool = False,
    ) -> None:
        if destinations not in ("buffers", "in_place"):
            raise ValueError(f"destinations={destinations!r}: expected buffers or in_place")
        self.bucket_size, self.is_master = bucket_size, is_master
        self.socket = socket or os.environ.get("WEIGHTWIRE_SOCKET") or None
        self.job, self.timeout_s = job, timeout_s
        self.staging_buckets, self.destinations = staging_buckets, destinations
        self.release_parameters = release_parameters
        self.role = ""
        self.rank, self.world_size = 0, 1
        self.trainer: Trainer | None = None
        self.engine: Engine | None = None
        self._kept: dict[str, torch.Tensor] = {}  # stream mode: this rank's share
        self._order: list[str] = []  # the stream's names, as first seen
        self._received: dict[str, torch.Tensor] = {}  # buffers mode
        self._version = 0  # when verl gives no global_steps

    # --- verl's set-up calls (each step; weightwire registers once) -----------

    def prepare(self) -> dict[str, Any]:
        return {"host": socket_mod.gethostname(), "pid": os.getpid()}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every actor worker is a trainer rank, every rollout worker an engine rank (an
        engine replica of its own); the daemons' plan is the topology."""
        actor = {
            "rank": list(range(actor_wg_world_size)),
            "world_size": [actor_wg_world_size] * actor_wg_world_size,
            "role": ["trainer"] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(rollout_world_size)),
            "world_size": [rollout_world_size] * rollout_world_size,
            "role": ["engine"] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, role: str) -> None:
        if self.role and (self.role, self.rank, self.world_size) != (role, rank, world_size):
            raise RegistrationError(
                f"weightwire checkpoint engine was {self.role} rank {self.rank} of "
                f"{self.world_size}, now asked to be {role} rank {rank} of {world_size}: "
                f"make a new engine for a new topology",
                code=ErrorCode.INVALID,
            )
        self.role, self.rank, self.world_size = role, rank, world_size
        if role == "trainer" and self.trainer is None:
            self.trainer = Trainer(
                rank,
                world_size,
                socket=self.socket,
                job=self.job,
                timeout_s=self.timeout_s,
                staging_buckets=self.staging_buckets,
            )
            module = _MODULES.get(self.job)
            if module is not None:
                self.trainer.register_module(module[0], module[1])
        elif role == "engine" and self.engine is None and self.destinations == "buffers":
            self.engine = Engine(
                rank,
                world_size,
                socket=self.socket,
                job=self.job,
                timeout_s=self.timeout_s,
                replica=rank,
                replica_size=1,
            )

    def finalize(self) -> None:
        """Nothing to free: registrations and plans stay for the next step."""

    def close(self) -> None:
        for client in (self.trainer, self.engine):
            if client is not None:
                client.close()
        self.trainer = self.engine = None

    # --- trainer side ---------------------------------------------------------

    async def send_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        tr = self._need(self.trainer, "trainer")
        version = self._next(global_steps)
        if self.job not in _MODULES:
            await self._keep_share(weights)
        stats = await asyncio.to_thread(tr.publish, version)
        if self.release_parameters and self.job in _MODULES:  # before verl offloads them
            tr.release_parameters()
        return {
            "weightwire/seconds": stats.seconds,
            "weightwire/bytes": float(stats.nbytes),
            "weightwire/transfer_seconds": stats.transfer_seconds,
        }

    async def _keep_share(self, weights: Any) -> None:
        """Stream mode: iterate the whole stream, keeping this rank's share (registered the
        first time, in memory the daemon sends from directly)."""
        tr = self._need(self.trainer, "trainer")
        first = not self._order
        names: list[str] = []
        share: dict[str, torch.Tensor] = {}
        i = 0
        async for name, tensor in _aiter(weights):
            names.append(name)
            if i % self.world_size == self.rank:
                if first:
                    share[name] = tensor.detach().to("cpu", copy=True).contiguous()
                else:
                    kept = self._kept.get(name)
                    if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                        raise RegistrationError(
                            f"tensor {name} of the stream differs from the first step's "
                            f"(a new tensor, shape or dtype): weightwire plans once",
                            code=ErrorCode.SHAPE_MISMATCH,
                        )
                    kept.copy_(tensor)
            i += 1
        if first:
            self._order = names
            mem = tr.allocate({n: (tuple(t.shape), t.dtype) for n, t in share.items()})
            for n, t in share.items():
                mem[n].copy_(t)
            self._kept = mem
            tr.register(mem)
            await asyncio.to_thread(tr.prepare)
        elif names != self._order:
            raise RegistrationError(
                "the stream's tensors are not the first step's, in the same order "
                f"({len(names)} now, {len(self._order)} then)",
                code=ErrorCode.SHAPE_MISMATCH,
            )

    # --- engine side ----------------------------------------------------------

    def register_destinations(
        self, tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Any] | None = None
    ) -> None:
        """Buffers mode: the tensors this rollout worker receives into (HF names; by
        default each the whole HF tensor of that name; `sources` as `Engine.register`)."""
        eng = self._need(self.engine, "engine")
        eng.register(dict(tensors), dict(sources or {}))
        self._received.update(tensors)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        version = self._next(global_steps)
        if self.destinations == "in_place":
            await asyncio.to_thread(self._wait_in_place, version)
            return
        eng = self._need(self.engine, "engine")
        if not self._received:
            raise RegistrationError(
                "weightwire buffers mode: call register_destinations first (or use "
                "destinations='in_place' with the SGLang plugin)",
                code=ErrorCode.INVALID,
            )
        await asyncio.to_thread(eng.wait, version, self.timeout_s)
        for name, tensor in self._received.items():
            yield name, tensor

    def _wait_in_place(self, version: int) -> None:
        """Until every engine rank of the job on this node (the SGLang plugin's) holds
        `version`; a failed version raises."""
        from weightwire.client.status import fetch
        from weightwire.protocol.errors import error_from_code
        from weightwire.protocol.local import SOCKET_PATH

        sock = self.socket or SOCKET_PATH
        deadline = time.monotonic() + self.timeout_s
        while True:
            ranks = [r for r in fetch(sock)["receiving"] if r["job"] == self.job]
            if any(version in r["failed"] for r in ranks):
                raise error_from_code(ErrorCode.TRANSFER.value, f"version {version} failed")
            if ranks and all(r["last_complete"] >= version for r in ranks):
                return
            if time.monotonic() > deadline:
                raise TimeoutError_(f"version {version} not in place after {self.timeout_s} s")
            time.sleep(0.05)

    # -------------------------------------------------------------------------

    def _next(self, global_steps: int | None) -> int:
        self._version = global_steps if global_steps is not None else self._version + 1
        return self._version

    def _need(self, client: Any, role: str) -> Any:
        if client is None:
            raise RegistrationError(
                f"weightwire checkpoint engine is not a {role} (init_process_group made it "
                f"{self.role or 'nothing yet'})",
                code=ErrorCode.INVALID,
            )
        return client


async def _aiter(weights: Any) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
