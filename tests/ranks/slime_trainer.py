"""One rank of slime's Megatron trainer actor as far as weights go, for tests/test_slime.py:
megatron.core's GPTModel (built as tests/ranks/megatron_trainer.py builds it, gloo, CPU)
with the recipe `weightwire.adapters.slime.UpdateWeightFromWeightwire` made and called the
way slime's `MegatronTrainRayActor` makes and calls its updater. Commands on stdin, one
JSON object a line:

- {"cmd": "setup", "job": ..., "hf": {HF config}, "tp", "pp", "ep", "etp", "divisible_by",
  "urls": [each rollout engine's URL]}: build this stage's model, write the HF config as
  slime's --hf-checkpoint directory, make the updater (args, [model], weights_getter,
  model_name, quantization_config), `connect_rollout_engines` with engine handles that
  answer `get_url` as slime's SGLangEngine does;
- {"cmd": "update", "train": bool}: with `train`, an optimizer-like in-place step first;
  this rank's parameters as they are saved to `<out>/<job>-v<next version>-r<rank>.pt`
  (for the test's own Megatron->HF conversion), then `update_weights()`; says `updated`
  with the version and `pop_metrics()`, or `update_failed` with the error;
- {"cmd": "close"}.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch

from tests.ranks.megatron_trainer import build, coordinates, fill, no_transformer_engine, step
from tests.ranks.megatron_trainer import tensors as megatron_tensors
from tests.ranks.rankloop import Ranked, say, serve, start
from weightwire.protocol.errors import WeightwireError


class EngineHandle:
    """What the recipe asks of slime's SGLangEngine actor handle: its URL."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get_url(self) -> str:
        return self.url


def main() -> None:
    warnings.filterwarnings("ignore")
    a = start(argparse.ArgumentParser())
    import megatron.core  # noqa: F401  (imported once, before the first setup)

    from weightwire.adapters.slime import UpdateWeightFromWeightwire

    no_transformer_engine()
    ranked = Ranked(a)
    state: dict[str, Any] = {}

    def setup(msg: dict[str, Any]) -> None:
        ranked.close()
        job, hf = msg["job"], msg["hf"]
        model = build(hf, msg["tp"], msg["pp"], msg["ep"], msg["etp"], msg["divisible_by"])
        fill(model)
        ckpt = os.path.join(a.out, f"{job}-hf")
        os.makedirs(ckpt, exist_ok=True)
        with open(os.path.join(ckpt, f"config.json.{a.rank}"), "w") as f:
            json.dump(hf, f)
        os.replace(os.path.join(ckpt, f"config.json.{a.rank}"), os.path.join(ckpt, "config.json"))
        args = argparse.Namespace(
            hf_checkpoint=ckpt,
            weightwire_socket=a.socket,
            weightwire_job=job,
            weightwire_timeout_s=60.0,
            weightwire_pause_mode="abort",
            weightwire_api_key=None,
        )
        updater = UpdateWeightFromWeightwire(
            args,
            [model],
            weights_getter=lambda: {},
            model_name=hf["model_type"],
            quantization_config=None,
        )
        ranked.tr = updater.trainer  # closed with the rank
        updater.connect_rollout_engines([EngineHandle(u) for u in msg["urls"]], None)
        state.update(job=job, model=model, updater=updater)
        say(event="ready", rank=a.rank, job=job, boxes=updater.registered, **coordinates())

    def update(msg: dict[str, Any]) -> None:
        model, updater, job = state["model"], state["updater"], state["job"]
        if msg.get("train"):
            step(model, updater.weight_version + 1, False)
        own = {n: p.detach().clone() for n, p in megatron_tensors(model).items()}
        version = updater.weight_version + 1
        path = os.path.join(a.out, f"{job}-v{version}-r{a.rank}.pt")
        torch.save({"params": own, **coordinates()}, path)
        try:
            updater.update_weights()
        except WeightwireError as exc:
            say(event="update_failed", rank=a.rank, version=version, message=str(exc))
            return
        say(event="updated", rank=a.rank, version=updater.weight_version, **updater.pop_metrics())

    serve(ranked, {"setup": setup, "update": update})


if __name__ == "__main__":
    main()
