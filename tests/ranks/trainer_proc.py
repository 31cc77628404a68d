"""A trainer rank process for end-to-end tests: register, prepare, then publish each version
number read from stdin, reporting JSON events with wall-clock times on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from weightwire.client import Shard, Trainer
from weightwire.protocol.errors import WeightwireError


def tensors(seed: int, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + version)
    return {
        "embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "proj": torch.randn(768, 256, generator=g).to(torch.bfloat16),
        "norm": torch.randn(256, generator=g),
    }


def say(**kw: object) -> None:
    print(json.dumps({**kw, "t": time.time()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    a = p.parse_args()
    full = tensors(0, 0)
    shapes = {n: tuple(t.shape) for n, t in full.items()}

    def mine(v: int) -> dict[str, torch.Tensor]:
        out = {}
        for n, t in tensors(0, v).items():
            step = -(-t.shape[0] // a.world)
            out[n] = t[a.rank * step : (a.rank + 1) * step].clone()
        return out

    cur = mine(0)
    with Trainer(a.rank, a.world, socket=a.socket, job=a.job, timeout_s=60) as tr:
        tr.register(cur, layout=Shard(0, a.rank, a.world), global_shapes=shapes)
        tr.prepare()
        say(event="ready", rank=a.rank)
        for line in sys.stdin:  # one version number per line, sent when the engines are ready
            v = int(line)
            for n, t in mine(v).items():
                cur[n].copy_(t)
            time.sleep(a.delay)
            say(event="start", rank=a.rank, version=v)
            try:
                s = tr.publish(v)
            except WeightwireError as exc:
                say(event="error", rank=a.rank, version=v, code=exc.code.value, message=exc.message)
                continue
            say(event="done", rank=a.rank, version=v, bytes=s.nbytes, seconds=s.seconds)


if __name__ == "__main__":
    main()
