"""Rank processes for the RDMA end-to-end test (they import torch, so they run on their own):

    python tests/rdma/ranks.py trainer --socket S --rank R --world W --job J
    python tests/rdma/ranks.py engines --socket S --world W --job J

A trainer publishes each version number read from stdin. The engines process holds all W
engine ranks (TP W, the first tensor sliced on dim 0), waits for each version number read
from stdin, and compares every tensor bitwise with what the trainers published. Events are
JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from weightwire.client import Engine, Rows, Shard, Trainer
from weightwire.protocol.errors import WeightwireError

SHAPES = {
    "w_up": ((1536, 1024), torch.float32),  # 6 MiB: writes of several MiB, striped over lanes
    "w_down": ((1024, 768), torch.bfloat16),
    "bias": ((1001,), torch.float32),  # odd sizes
}


_BASE: dict[str, torch.Tensor] = {}


def model(version: int) -> dict[str, torch.Tensor]:
    """Version v: random base tensors (made once) rolled by v * 1013 elements: different
    bytes every version at the cost of a copy (random numbers are slow in the TCG VM)."""
    if not _BASE:
        g = torch.Generator().manual_seed(7919)
        _BASE.update({n: torch.randn(*s, generator=g).to(dt) for n, (s, dt) in SHAPES.items()})
    return {n: b.flatten().roll(version * 1013).view(b.shape) for n, b in _BASE.items()}


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    step = -(-n // world)
    return min(n, rank * step), min(n, (rank + 1) * step)


def say(**event: object) -> None:
    print(json.dumps({**event, "t": time.time()}), flush=True)


def trainer(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)

    def mine(v: int) -> dict[str, torch.Tensor]:
        out = {}
        for n, t in model(v).items():
            lo, hi = rows(t.shape[0], a.rank, a.world)
            out[n] = t[lo:hi].clone()
        return out

    cur = mine(0)
    shapes = {n: s for n, (s, _) in SHAPES.items()}
    with Trainer(a.rank, a.world, socket=a.socket, job=a.job, timeout_s=120) as tr:
        tr.register(cur, layout=Shard(0, a.rank, a.world), global_shapes=shapes)
        tr.prepare()
        say(event="ready", rank=a.rank)
        for line in sys.stdin:
            v = int(line)
            for n, t in mine(v).items():
                cur[n].copy_(t)
            try:
                s = tr.publish(v)
            except WeightwireError as exc:
                say(event="error", rank=a.rank, version=v, code=exc.code.value, message=exc.message)
                continue
            say(event="done", rank=a.rank, version=v, bytes=s.nbytes, writes=s.writes)


def engines(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ranks = []
    for r in range(a.world):
        mine, sources = {}, {}
        for n, ((shape), dt) in SHAPES.items():
            if n == "w_up":
                lo, hi = rows(shape[0], r, a.world)
                mine[n] = torch.zeros(hi - lo, *shape[1:], dtype=dt)
                sources[n] = Rows(tuple(shape), lo, hi)
            else:
                mine[n] = torch.zeros(*shape, dtype=dt)
        eng = Engine(r, a.world, socket=a.socket, job=a.job, timeout_s=120)
        eng.register(mine, sources)
        ranks.append((eng, mine))
    say(event="ready")
    for line in sys.stdin:
        v = int(line)
        want = model(v)
        for r, (eng, mine) in enumerate(ranks):
            try:
                info = eng.wait(v, timeout_s=60)
            except WeightwireError as exc:
                say(event="failed", rank=r, version=v, code=exc.code.value, message=exc.message)
                continue
            bad = []
            for n, got in mine.items():
                w = want[n]
                if n == "w_up":
                    lo, hi = rows(w.shape[0], r, a.world)
                    w = w[lo:hi]
                if not torch.equal(got.view(torch.uint8), w.contiguous().view(torch.uint8)):
                    bad.append(n)
            say(event="landed", rank=r, version=v, bytes=info.nbytes, bitwise=not bad, bad=bad)
    for eng, _ in ranks:
        eng.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "engines"])
    p.add_argument("--socket", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--job", required=True)
    a = p.parse_args()
    trainer(a) if a.role == "trainer" else engines(a)


if __name__ == "__main__":
    main()
