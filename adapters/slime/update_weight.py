"""`UpdateWeightFromWeightwire`: slime's Megatron weight updater, backed by weightwire.

slime's trainer actor (`MegatronTrainRayActor` in slime/backends/megatron_utils/actor.py)
picks its updater class from `--update-weight-transport` / `--colocate`
(`UpdateWeightFromDistributed`, `UpdateWeightFromTensor`, `UpdateWeightFromDisk`, in
slime/backends/megatron_utils/update_weight/), makes it on every rank as
``cls(args, model, weights_getter=..., model_name=..., quantization_config=...)``, and in
its `update_weights` calls, on every rank, ``connect_rollout_engines(engines, lock,
engine_gpu_counts=..., engine_gpu_offsets=..., engine_parallel_configs=...)`` when new
engines are up, then ``update_weights()``, and later ``pop_metrics()`` onto the step's log.
This class has that shape; what it does inside differs:

- slime's NCCL path all-gathers every TP shard and every EP batch to the DP=TP=0 rank of
  each pipeline stage, converts to HF names there and broadcasts each bucket to every
  engine GPU. Here every rank registers its own Megatron shards once
  (`Trainer.register_megatron`: interleaved QKV, fused fc1, experts over EP, pipeline
  stages, padded vocabulary as they are) and each update every rank writes exactly the
  bytes each engine rank needs, at once; nothing is gathered or converted on the trainer.
- `connect_rollout_engines` makes no process group: rank 0 keeps an HTTP client per engine
  (`SGLangEngine.get_url`) and every rank fetches its plan (engines registered their
  parameters in place through the weightwire SGLang plugin: `engine_env`).
- `update_weights`: version += 1; rank 0 pauses generation, flushes the cache and opens
  the weight-update session on every engine; then every rank publishes (returning once its
  writes landed); rank 0 closes the session, sets the engines' weight version and continues
  generation (`weightwire.adapters.sglang.lifecycle.update_weights`). A failure on any rank
  is raised on every rank, none waits forever: before the transfer nothing changed and
  generation continues; from the transfer on the engines stay paused (see that function).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightwire.adapters.sglang.lifecycle import SGLangClient, update_weights
from weightwire.client import Trainer
from weightwire.protocol.errors import ErrorCode, RegistrationError, TransferError

from .rollout import engine_urls


def hf_config_of(args: Namespace, hf_config: Any = None) -> dict[str, Any]:
    """The HF config the engines are built from: `hf_config` (a dict or a transformers
    config) or `<args.hf_checkpoint>/config.json` (slime's `--hf-checkpoint`)."""
    if hf_config is not None:
        return dict(hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict())
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise RegistrationError(
            "no HF config: pass hf_config= or set args.hf_checkpoint (slime's --hf-checkpoint)",
            code=ErrorCode.INVALID,
        )
    try:
        return dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise RegistrationError(
            f"cannot read the HF config {Path(path) / 'config.json'}: {exc}",
            code=ErrorCode.INVALID,
        ) from exc


class UpdateWeightFromWeightwire:
    """slime's updater interface over weightwire. Made on every trainer rank, after the
    model (and Megatron's parallel_state) exists; registers this rank's shards at once.

    weightwire settings: keyword arguments, else `args.weightwire_<name>` (the flags
    `add_arguments` adds), else the defaults: `socket` (WEIGHTWIRE_SOCKET or the daemon's
    default), `job` ("slime", the engines' WEIGHTWIRE_JOB), `timeout_s` (300), `pause_mode`
    ("abort", as slime's /pause_generation), `api_key` (the engines'). `hf_config`: see
    `hf_config_of`. `skip(name)`: Megatron parameters to leave out (e.g. MTP layers).
    `group`: a gloo group of every trainer rank for the small handshakes (default: a new
    one). miles (radixark/miles, slime's fork) makes its updaters the same way, with an
    `is_lora` flag: LoRA is refused. `weights_getter` is accepted and unused: parameters
    are read in place, as slime's UpdateWeightFromDistributed reads `model`."""

    def __init__(
        self,
        args: Namespace,
        model: Sequence[torch.nn.Module],
        weights_getter: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        *,
        model_name: str = "",
        quantization_config: Mapping[str, Any] | None = None,
        hf_config: Any = None,
        socket: str | None = None,
        job: str | None = None,
        timeout_s: float | None = None,
        pause_mode: str | None = None,
        api_key: str | None = None,
        skip: Callable[[str], bool] | None = None,
        group: Any = None,
        is_lora: bool = False,
    ) -> None:
        if is_lora:
            raise RegistrationError(
                "LoRA weight sync (miles' is_lora) is not supported by the weightwire recipe: "
                "it registers the base model's Megatron parameters",
                code=ErrorCode.INVALID,
            )

        def setting(name: str, given: Any, default: Any) -> Any:
            if given is not None:
                return given
            value = getattr(args, f"weightwire_{name}", None)
            return default if value is None else value

        self.args, self.model, self.model_name = args, model, model_name
        self.quantization_config = quantization_config
        self.weight_version = 0  # slime's actor sets update_weight_start_version
        self.update_weight_metrics: dict[str, float] = {}
        self.hf_config = hf_config_of(args, hf_config)
        self.job = str(setting("job", job, "slime"))
        self.timeout_s = float(setting("timeout_s", timeout_s, 300.0))
        self.pause_mode = str(setting("pause_mode", pause_mode, "abort"))
        self.api_key = setting("api_key", api_key, None)
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode={self.pause_mode!r}: abort, retract or in_place")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.trainer = Trainer(
            self.rank,
            self.world,
            socket=setting("socket", socket, os.environ.get("WEIGHTWIRE_SOCKET") or None),
            job=self.job,
            timeout_s=self.timeout_s,
        )
        self.registered = self.trainer.register_megatron(list(model), self.hf_config, skip=skip)
        self.rollout_engines: Sequence[Any] = ()
        self._clients: list[SGLangClient] | None = None

    # --- slime's updater calls --------------------------------------------------------

    def connect_rollout_engines(
        self,
        rollout_engines: Sequence[Any],
        rollout_engine_lock: Any = None,
        engine_gpu_counts: Sequence[int] | None = None,
        engine_gpu_offsets: Sequence[int] | None = None,
        engine_parallel_configs: Sequence[Mapping[str, object]] | None = None,
    ) -> None:
        """Every rank, whenever slime has new engines. No process group and no lock (no
        collective with the engines can deadlock): rank 0 keeps a client per engine, and
        every rank fetches its plan (which waits until the engines have registered)."""
        self.rollout_engines = list(rollout_engines)
        if self.rank == 0:
            urls = engine_urls(self.rollout_engines)
            if not urls:
                raise RegistrationError(
                    f"none of the {len(self.rollout_engines)} rollout engines gave a URL "
                    "(SGLangEngine.get_url)",
                    code=ErrorCode.INVALID,
                )
            self._clients = [
                SGLangClient(u, api_key=self.api_key, timeout_s=self.timeout_s) for u in urls
            ]
        else:
            self._clients = []
        self.trainer.prepare(self.timeout_s)

    def disconnect_rollout_engines(self) -> None:
        """Nothing to tear down: registrations and the plan stay for the next update."""

    def pop_metrics(self) -> dict[str, float]:
        out, self.update_weight_metrics = self.update_weight_metrics, {}
        return out

    @torch.no_grad()
    def update_weights(self) -> None:
        """Every rank: one version of the weights into every engine (see the module)."""
        if self._clients is None:
            raise RegistrationError(
                "update_weights before connect_rollout_engines", code=ErrorCode.INVALID
            )
        self.weight_version += 1
        version = self.weight_version
        t0 = time.perf_counter()
        if self.rank == 0:
            self._drive(version)
        else:
            go = self._from_rank0(None)
            if go is not None:
                raise TransferError(f"version {version} not sent: rank 0: {go}")
            error: Exception | None = None
            try:
                self._send(version)
            except Exception as exc:
                error = exc
            done = self._from_rank0(None)
            if error is not None:
                raise error
            if done is not None:
                raise TransferError(f"version {version}: rank 0: {done}")
        self.update_weight_metrics["weightwire/update_seconds"] = time.perf_counter() - t0

    # --- inside -----------------------------------------------------------------------

    def _drive(self, version: int) -> None:
        """Rank 0: the engines' calls around every rank's transfer."""
        assert self._clients is not None
        told = False

        def transfer() -> None:
            nonlocal told
            self._from_rank0(None)  # the engines are paused, their sessions open: go
            told = True
            self._send(version)

        error: Exception | None = None
        try:
            report = asyncio.run(
                update_weights(
                    self._clients,
                    version,
                    lambda: asyncio.to_thread(transfer),
                    pause_mode=self.pause_mode,  # type: ignore[arg-type]
                )
            )
            self.update_weight_metrics["weightwire/paused_seconds"] = report.paused_s
        except Exception as exc:
            error = exc
        # the others wait for either "go" (before the transfer) or "done" (after it)
        self._from_rank0(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error

    def _send(self, version: int) -> None:
        """Every rank: publish its own shards; then all ranks learn whether each did."""
        mine: str | None = None
        error: Exception | None = None
        try:
            stats = self.trainer.publish(version)
            self.update_weight_metrics["weightwire/publish_seconds"] = stats.seconds
            self.update_weight_metrics["weightwire/bytes"] = float(stats.nbytes)
        except Exception as exc:
            error, mine = exc, f"rank {self.rank}: {type(exc).__name__}: {exc}"
        outcomes: list[str | None] = [None] * self.world
        dist.all_gather_object(outcomes, mine, group=self.group)
        if error is not None:
            raise error
        failed = [o for o in outcomes if o]
        if failed:
            raise TransferError(
                f"version {version} did not land from every trainer rank: " + "; ".join(failed)
            )

    def _from_rank0(self, message: str | None) -> str | None:
        box: list[str | None] = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def add_arguments(parser: Any) -> Any:
    """slime's argument parser gets `--weightwire-socket`, `--weightwire-job`,
    `--weightwire-timeout-s`, `--weightwire-pause-mode` and `--weightwire-api-key`."""
    parser.add_argument("--weightwire-socket", default=None)
    parser.add_argument("--weightwire-job", default="slime")
    parser.add_argument("--weightwire-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--weightwire-pause-mode", default="abort", choices=["abort", "retract", "in_place"]
    )
    parser.add_argument("--weightwire-api-key", default=None)
    return parser
