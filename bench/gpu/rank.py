"""One rank of `weightwire bench gpu`, as its own process:
`python -m weightwire.bench.gpu.rank trainer|engine ...`.

It talks to the launcher with JSON lines (commands on stdin, events on stdout), like the
demo's ranks. Every rank also joins one torch.distributed group (NCCL on GPUs, gloo on
CPU) for the baseline and a gloo group for the barriers that start each timed sync.

Commands: `gen` (trainers: new weights of a version, untimed), `ww` (a weightwire sync:
barrier, trainers publish, engines wait), `base` (the broadcast baseline: barrier, per
bucket all_gather on the trainers, broadcast from trainer 0, copy-in on the engines),
`verify` (engines: every tensor bitwise against the expected bytes), `quit`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback

from weightwire.protocol.errors import WeightwireError

from .rank_base import say
from .rank_engine import EngineRank
from .rank_trainer import TrainerRank


def serve(rank: TrainerRank | EngineRank) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "quit":
            break
        v = int(cmd.get("version", 0))
        try:
            if what == "gen":
                out = {"seconds": rank.gen(v) if isinstance(rank, TrainerRank) else 0.0}
            elif what == "ww":
                out = rank.ww(v)
            elif what == "base":
                out = rank.base(v)
            elif what == "verify" and isinstance(rank, EngineRank):
                out = rank.verify(v)
            else:
                raise ValueError(f"unknown command {what!r} for a {rank.args.role}")
        except WeightwireError as exc:
            say(event="error", cmd=what, version=v, code=exc.code.value, message=exc.message)
            continue
        say(event="done", cmd=what, version=v, **out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "engine"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--config", required=True, help="the (possibly shrunk) HF config, JSON")
    p.add_argument("--dest", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="bench-gpu")
    p.add_argument("--staging", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--zero-copy", action="store_true")
    p.add_argument("--direct", action="store_true")
    p.add_argument("--staging-buckets", type=int, default=4, help="0: the whole send")
    p.add_argument(
        "--slot-wait",
        choices=["counters", "packed", "events", "landing"],
        default="counters",
        help="how a ring slot is waited for: GPU counters (Trainer(slot_counters=True)) with "
        "each bucket posted before it is packed (gate_copies, the copies wait on the GPU), "
        "the same posted once packed (packed), the daemon's IPC events (slot_events), or "
        "the landing on this thread",
    )
    p.add_argument("--trainer-layout", choices=["fsdp", "full"], default="fsdp")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument(
        "--dist-store", required=True, help="a fresh file: the ranks' torch.distributed rendezvous"
    )
    p.add_argument("--nccl", action="store_true")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    rank: TrainerRank | EngineRank | None = None
    try:
        t0 = time.perf_counter()
        rank = TrainerRank(args) if args.role == "trainer" else EngineRank(args)
        say(
            event="ready",
            role=args.role,
            rank=args.rank,
            gpu=args.gpu if args.device == "cuda" else None,
            setup_s=time.perf_counter() - t0,
            **rank.summary,
        )
        serve(rank)
    except WeightwireError as exc:
        say(event="fatal", code=exc.code.value, message=exc.message)
        sys.exit(1)
    except Exception as exc:
        say(event="fatal", code="exception", message=f"{exc!r}\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        if rank is not None:
            with contextlib.suppress(Exception):
                rank.close()


if __name__ == "__main__":
    main()
