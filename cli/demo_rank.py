"""One rank of the demo, as its own process: `python -m weightwire.cli.demo_rank ...`.

It talks to the demo controller with JSON lines: commands on stdin, events on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from weightwire.client import Engine, Rows, Shard, Trainer
from weightwire.harness import synthetic
from weightwire.protocol.errors import WeightwireError


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def trainer(args: argparse.Namespace, model: list[synthetic.TensorDef]) -> None:
    current, shapes, spans = {}, {}, {}
    for t in model:
        spans[t.name] = synthetic.rows(t.shape[0], args.rank, args.world)
        current[t.name] = synthetic.content(t, *spans[t.name], version=0)
        shapes[t.name] = t.shape
    defs = {t.name: t for t in model}
    with Trainer(
        args.rank, args.world, socket=args.socket, timeout_s=args.timeout, delta=args.delta
    ) as tr:
        tr.register(current, layout=Shard(0, args.rank, args.world), global_shapes=shapes)
        nbytes = sum(b.nbytes for b in current.values())
        say(event="ready", role="trainer", rank=args.rank, bytes=nbytes)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            v = int(cmd["version"])
            if cmd["cmd"] == "prepare":  # the training step: new weights, untimed
                t0 = time.perf_counter()
                for name, dst in current.items():
                    if args.delta != "off" and v > 1:  # sparse steps, as RL updates are
                        synthetic.step(defs[name], *spans[name], dst, v, args.density)
                    else:
                        dst.copy_(synthetic.content(defs[name], *spans[name], version=v))
                if v == 1:
                    tr.prepare()
                say(event="prepared", version=v, seconds=time.perf_counter() - t0)
                continue
            try:
                s = tr.publish(v)
            except WeightwireError as exc:
                say(event="error", version=v, code=exc.code.value, message=exc.message)
                continue
            say(
                event="published",
                version=v,
                bytes=s.nbytes,
                writes=s.writes,
                seconds=s.seconds,
                pack_seconds=s.pack_seconds,
                total_seconds=s.total_seconds,
                delta_bytes=s.delta_bytes,
                density=s.density,
            )


def engine(args: argparse.Namespace, model: list[synthetic.TensorDef]) -> None:
    tensors, sources, spans = {}, {}, {}
    for t in model:
        if t.parallel == "col":
            lo, hi = synthetic.rows(t.shape[0], args.rank, args.world)
            sources[t.name] = Rows(t.shape, lo, hi)
        else:
            lo, hi = 0, t.shape[0]
        spans[t.name] = (t, lo, hi)
        tensors[t.name] = torch.zeros((hi - lo, *t.shape[1:]), dtype=torch.bfloat16)
    area = 0.25 if args.delta != "off" else 0.0
    expected = {name: synthetic.content(*spans[name], version=1) for name in tensors}
    with Engine(
        args.rank, args.world, socket=args.socket, timeout_s=args.timeout, delta_area=area
    ) as eng:
        eng.register(tensors, sources)
        nbytes = sum(t.nbytes for t in tensors.values())
        say(event="ready", role="engine", rank=args.rank, bytes=nbytes)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            v = int(cmd["version"])
            try:
                info = eng.wait(v)
            except WeightwireError as exc:
                say(event="error", version=v, code=exc.code.value, message=exc.message)
                continue
            t0 = time.perf_counter()
            for name, want in expected.items():
                if args.delta != "off" and v > 1:
                    synthetic.step(*spans[name], want, v, args.density)
                else:
                    want.copy_(synthetic.content(*spans[name], version=v))
            bad = [
                name
                for name, dst in tensors.items()
                if not torch.equal(dst.view(torch.uint8), expected[name].view(torch.uint8))
            ]
            say(
                event="verified",
                version=v,
                ok=not bad,
                mismatched=bad[:5],
                bytes=nbytes,
                landed_bytes=info.nbytes,
                seconds=info.seconds,
                verify_seconds=time.perf_counter() - t0,
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "engine"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--model-gb", type=float, required=True)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--delta", choices=["off", "auto", "on"], default="off")
    p.add_argument("--density", type=float, default=0.02)
    args = p.parse_args()
    # several rank processes share few cores: torch's intra-op threads would only spin
    torch.set_num_threads(1)
    model = synthetic.qwen3_of_size(args.model_gb)
    try:
        (trainer if args.role == "trainer" else engine)(args, model)
    except WeightwireError as exc:
        say(event="fatal", code=exc.code.value, message=exc.message)
        sys.exit(1)


if __name__ == "__main__":
    main()
