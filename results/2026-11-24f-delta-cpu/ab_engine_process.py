"""The engine rank in the trainer's process (as `bench delta` runs it) against its own
process (as an engine runs), alternated round by round.

Two daemons in network namespaces per variant, tcp, 10 Gbit/s, 8 x 8192^2 bf16, versions
alternating between A and B (B: A with the low bit of 4.2 % of its elements flipped);
every version checked against the trainer's bytes (xxh3 of the engine's tensors, computed
in the engine's process). Prints each variant's delta seconds.

    .venv/bin/python results/2026-11-24f-delta-cpu/ab_engine_process.py ROUNDS
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch
import xxhash


def digest(tensors: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for n in sorted(tensors):
        h.update(tensors[n].view(torch.uint8).numpy().data)
    return h.intdigest()


def engine_process(sock: str, job: str, shapes: dict[str, Any], conn: Connection) -> None:
    from weightwire.client import Engine

    dst = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    eng = Engine(0, 1, socket=sock, job=job, timeout_s=600, delta_area=0.25)
    eng.register(dst)
    conn.send("ready")
    while (v := conn.recv()) is not None:
        eng.wait(v)
        conn.send(digest(dst))
    eng.close()


def main() -> None:
    from ab_client import report, start, versions  # this script's folder is on the path

    from weightwire.client import Engine, Trainer
    from weightwire.harness import netns

    rounds = int(sys.argv[1])
    use_netns, why = netns.available()
    if not use_netns:
        raise SystemExit(f"needs network namespaces: {why}")
    a, b = versions()
    want = {0: digest(a), 1: digest(b)}
    params = {n: t.clone() for n, t in a.items()}
    ctx = mp.get_context("spawn")
    runs: list[dict[str, Any]] = []
    try:
        for variant in ("in-process", "own-process"):
            run = start(runs, variant, {"version-timeout-s": "600"})
            job, sock = f"ep-{variant}", run["cluster"].daemons[1].socket
            if variant == "in-process":
                dst = {n: torch.zeros_like(t) for n, t in params.items()}
                eng = Engine(0, 1, socket=sock, job=job, timeout_s=600, delta_area=0.25)
                eng.register(dst)
                run.update(eng=eng, dst=dst)
            else:
                mine, theirs = ctx.Pipe()
                shapes = {n: t.shape for n, t in params.items()}
                proc = ctx.Process(target=engine_process, args=(sock, job, shapes, theirs))
                proc.start()
                assert mine.recv() == "ready"
                run.update(pipe=mine, proc=proc)
            trainer_sock = run["cluster"].daemons[0].socket
            tr = Trainer(0, 1, socket=trainer_sock, job=job, timeout_s=600, delta="auto")
            tr.register(params)
            tr.prepare()
            run["tr"] = tr

        def landed(run: dict[str, Any], v: int) -> int:
            if "eng" in run:
                run["eng"].wait(v)
                return digest(run["dst"])
            run["pipe"].send(v)
            return int(run["pipe"].recv())

        for run in runs:
            run["tr"].publish(0)
            assert landed(run, 0) == want[0]
        for r in range(rounds + 1):
            for n in params:
                params[n].copy_((b if r % 2 == 0 else a)[n])
            for run in runs if r % 2 else runs[::-1]:
                run["v"] += 1
                d = run["tr"].publish(run["v"])
                assert landed(run, run["v"]) == want[1 if r % 2 == 0 else 0], run["variant"]
                if r:
                    run["times"].append(d.total_seconds)
        report(runs)
    finally:
        for run in runs:
            if "tr" in run:
                run["tr"].close()
            if "eng" in run:
                run["eng"].close()
            if "proc" in run:
                run["pipe"].send(None)
                run["proc"].join(30)
            run["cluster"].stop()


if __name__ == "__main__":
    main()
