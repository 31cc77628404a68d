"""`weightwire bench rpc`: what a local request costs, against raw pyzmq (CPU).

Three round trips, each over many iterations, in one run (so that their ratios, not the
absolute figures, are what to compare on a loaded machine):

- raw: a pyzmq DEALER in this process to a ROUTER echo in a child process over an ipc
  socket (the baseline: what ZeroMQ alone costs between two processes);
- ping: `DaemonConnection.request(Ping())` against one real daemon (the client's and the
  daemon's request path with no work behind it);
- begin: the BeginVersion round trip of a trainer's publish (`begin_request_seconds`) for a
  plan of `--writes` writes on host memory, and the whole `begin_seconds`.

For ping and begin, where the client's time goes (`DaemonConnection.last_trace`): from the
request call until the request is sent, from the send until the reply is read, and from
reading the reply until the caller wakes. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

_ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = s.recv_multipart()
    if frames[-1] == b"stop":
        break
    s.send_multipart(frames)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iters", type=int, default=2000, help="round trips of raw and ping")
    p.add_argument("--versions", type=int, default=200, help="publishes measured for begin")
    p.add_argument("--writes", type=int, default=512, help="writes in the begin's plan")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle time before each ping and each version (a cold round trip: the daemon idle)",
    )
    p.add_argument("--profile", metavar="FILE", help="run the daemon under cProfile into FILE")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _summary(xs: list[float]) -> dict[str, float]:
    return {k: round(_pct(xs, q) * 1e6, 1) for k, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}


def raw_roundtrips(iters: int) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        addr = f"ipc://{d}/echo"
        child = subprocess.Popen(
            [sys.executable, "-c", _ECHO, addr], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            payload = b"x" * 64
            for _ in range(50):  # warm-up
                s.send_multipart([b"", payload])
                s.recv_multipart()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                s.send_multipart([b"", payload])
                s.recv_multipart()
                times.append(time.perf_counter() - t)
            s.send_multipart([b"", b"stop"])
            s.close()
            ctx.term()
        finally:
            child.wait(5)
    return times


def _split(traces: list[tuple[float, float, float, float]]) -> dict[str, dict[str, float]]:
    return {
        "call_to_send_us": _summary([s - c for c, s, _, _ in traces]),
        "send_to_reply_read_us": _summary([r - s for _, s, r, _ in traces]),
        "reply_read_to_wake_us": _summary([w - r for _, _, r, w in traces]),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from weightwire.client import Engine, Trainer
    from weightwire.harness.localcluster import LocalCluster
    from weightwire.protocol.local import BeginVersion, Ping

    out: dict[str, Any] = {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    out["raw_us"] = _summary(raw_roundtrips(args.iters))
    kib = 4
    flags = {"bucket-bytes": str(kib << 10), "max-write-bytes": str(kib << 10)}
    python = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    c = LocalCluster(hosts=1, insecure=True, extra=flags, python=python)
    c.start()
    try:
        rows = args.writes * kib  # float32 rows of 1 KiB: one write per 4 KiB bucket
        dst = torch.zeros(rows, 256)
        sock = c.daemons[0].socket
        eng = Engine(0, 1, socket=sock, job="rpc", timeout_s=60)
        eng.register({"w": dst})
        w = torch.zeros(rows, 256)
        with Trainer(0, 1, socket=sock, job="rpc", timeout_s=60) as tr:
            tr.register({"w": w})
            plan = tr.prepare()
            out["writes"] = sum(len(b.writes) for b in plan.buckets)
            conn = tr._conn
            pings, ptr = [], []
            for i in range(args.iters + 50):
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1e3)
                t = time.perf_counter()
                conn.request(Ping())
                if i >= 50:
                    pings.append(time.perf_counter() - t)
                    ptr.append(conn.last_traces[Ping])
            begins, requests, btr = [], [], []
            for version in range(args.versions + 3):
                w.fill_(float(version))
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1e3)
                stats = tr.publish(version)
                eng.wait(version)
                if version == args.versions + 2 and not torch.equal(dst, w):
                    raise RuntimeError(f"version {version}: the engine's bytes differ")
                if version < 3:
                    continue
                begins.append(stats.begin_seconds)
                requests.append(stats.begin_request_seconds)
                btr.append(conn.last_traces[BeginVersion])
        eng.close()
    finally:
        out["daemon_exit"] = c.stop()
    out["ping_us"] = _summary(pings)
    out["ping_split"] = _split(ptr)
    out["begin_request_us"] = _summary(requests)
    out["begin_split"] = _split(btr)
    out["begin_us"] = _summary(begins)
    raw = out["raw_us"]["p50"]
    out["ping_over_raw"] = round(out["ping_us"]["p50"] / raw, 2)
    out["begin_request_over_raw"] = round(out["begin_request_us"]["p50"] / raw, 2)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(f"{out['cpus']} cpus, load {out['load']:.1f}; p10/p50/p90 in us")
    for key in ("raw_us", "ping_us", "begin_request_us", "begin_us"):
        print(f"  {key:18s} {out[key]}")
    for key in ("ping_split", "begin_split"):
        for part, v in out[key].items():
            print(f"  {key}.{part:24s} {v}")
    print(
        f"  ping = {out['ping_over_raw']} x raw, begin request = "
        f"{out['begin_request_over_raw']} x raw ({out['writes']} writes)"
    )
    return 0
