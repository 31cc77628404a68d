"""One rank of a real FSDP2 trainer (torch.distributed on gloo, CPU) for tests/test_fsdp2.py.

A tiny Qwen3-shaped model with HF parameter names under a wrapper (`inner.`), sharded with
`fully_shard` on a 1-D mesh, an HSDP mesh (replicate x shard) or a 2-D mesh (FSDP over
TP: ColwiseParallel / RowwiseParallel linears), registered with `Trainer.register_module`
as it is. Commands on stdin, one JSON object a line:

- {"cmd": "setup", "mesh": "1d" | "hsdp" | "2d", "job": ..., "dtype": "float32" | ...}: build,
  shard, register, prepare;
- {"cmd": "publish", "version": v}: an optimizer-like in-place step on every local shard,
  then torch's own `full_tensor()` of every parameter (rank 0 saves them, HF-named, to
  `<out>/<job>-v<v>.pt`: the unsharded model to check against), then `publish(v)`;
- {"cmd": "close"}.

Events on stdout, one JSON object a line.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.ranks.rankloop import Ranked, say, serve, start


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = Norm(d)
        self.k_norm = Norm(d)


class Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class Mlp(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = Mlp(c)
        self.input_layernorm = Norm(c["hidden_size"])
        self.post_attention_layernorm = Norm(c["hidden_size"])


class Body(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = Norm(c["hidden_size"])


class Qwen3(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)


class Wrapped(nn.Module):
    """What a framework hands over: the HF model one level down (`inner.`)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.inner = Qwen3(c)


def build(c: dict[str, Any], mesh_kind: str, world: int, dtype: torch.dtype) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)  # the same initial weights on every rank, as FSDP2 expects
    model = Wrapped(c)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model = model.to(dtype)
    if mesh_kind == "1d":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    elif mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        col, row = ColwiseParallel(), RowwiseParallel()
        for layer in model.inner.model.layers:
            parallelize_module(
                layer,
                mesh2["tp"],
                {
                    "self_attn.q_proj": col,
                    "self_attn.k_proj": col,
                    "self_attn.v_proj": col,
                    "self_attn.o_proj": row,
                    "mlp.gate_proj": col,
                    "mlp.up_proj": col,
                    "mlp.down_proj": row,
                },
            )
        mesh = mesh2["dp"]
    for layer in model.inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: nn.Module, version: int) -> None:
    """An optimizer-like update, in place on every local shard (the same on replicas)."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.mul_(0.75).add_(version / 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="the model's config, JSON")
    ap.add_argument("--staging-buckets", type=int, default=4)
    a = start(ap)
    cfg = json.loads(a.config)
    model: Wrapped | None = None
    ranked = Ranked(a)
    job = ""

    def setup(msg: dict[str, Any]) -> None:
        nonlocal model, job
        ranked.close()
        job = msg["job"]
        dtype = getattr(torch, msg.get("dtype", "bfloat16"))
        model = build(cfg, msg["mesh"], a.world, dtype)
        tr = ranked.trainer(job)
        boxes = tr.register_module(model, rename=lambda n: n.removeprefix("inner."))
        tr.prepare()
        say(event="ready", rank=a.rank, job=job, boxes=boxes)

    def publish(msg: dict[str, Any]) -> None:
        assert model is not None
        v = msg["version"]
        step(model, v)
        full = {n.removeprefix("inner."): p.full_tensor() for n, p in model.named_parameters()}
        if a.rank == 0:
            torch.save(full, os.path.join(a.out, f"{job}-v{v}.pt"))
        dist.barrier()
        ranked.publish(v)

    serve(ranked, {"setup": setup, "publish": publish})


if __name__ == "__main__":
    main()
