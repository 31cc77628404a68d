"""bench delta's run_lr steps at one link, alternated in one process: with the bench's
density bookkeeping (a 1 GB clone before the step, a compare after it) right before each
publish, and without. Usage: lead_bench_order.py LINK|none ROUNDS. `one(..., separate=True)`
puts the engine rank in a process of its own (its bitwise check is not valid there: the
spawned process gets a copy of the tensors)."""

import gc
import multiprocessing as mp
import statistics
import sys
import types

import torch

import weightwire.bench.delta as bd
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

DENS = False  # the bench's density bookkeeping before each publish (set per run)


def engine_main(sock, job, dst, conn):
    from weightwire.client import Engine

    eng = Engine(0, 1, socket=sock, job=job, timeout_s=600, delta_area=0.25)
    eng.register(dst)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        eng.wait(msg)
        rx = eng.delta
        conn.send((rx.early_s if rx else 0.0, rx.tail_s if rx else 0.0))
    eng.close()


class Proxy:
    def __init__(self, sock, job, dst):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=engine_main, args=(sock, job, dst, child))
        self.p.start()
        assert self.conn.recv() == "ready"
        self.delta = None

    def wait(self, v):
        self.conn.send(v)
        e, t = self.conn.recv()
        self.delta = types.SimpleNamespace(early_s=e, tail_s=t)

    def close(self):
        self.conn.send(None)
        self.p.join(30)


def one(cluster, lr, job, separate, steps=3):
    from weightwire.client import Engine, Trainer

    model = bd.Model(8, 8192, lr)
    dst = {n: torch.zeros_like(t) for n, t in model.bf16.items()}
    if separate:
        for t in dst.values():
            t.share_memory_()
        eng = Proxy(cluster.daemons[1].socket, job, dst)
    else:
        eng = Engine(
            0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=600, delta_area=0.25
        )
        eng.register(dst)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=600, delta="auto")
    tr.register(model.bf16)
    tr.prepare()
    v = 0
    tr.publish(v)
    eng.wait(v)
    ok = bd._bitwise(dst, model.bf16)
    ds, ns, scans = [], [], []
    for _ in range(steps):
        before = {n: t.clone() for n, t in model.bf16.items()} if DENS else None
        model.step()
        if DENS:
            bd._density(before, model.bf16)
            del before
        v += 1
        tr.delta.mode = "auto"
        d = tr.publish(v)
        scans.append(tr.delta.phases.get("scan", 0))
        eng.wait(v)
        ok &= bd._bitwise(dst, model.bf16)
        v += 1
        tr.delta.mode = "off"
        n = tr.publish(v)
        eng.wait(v)
        ok &= bd._bitwise(dst, model.bf16)
        ds.append(d.total_seconds)
        ns.append(n.total_seconds)
    tr.close()
    eng.close()
    return statistics.median(ds), statistics.median(ns), statistics.median(scans), ok


if __name__ == "__main__":
    link = None if sys.argv[1] == "none" else float(sys.argv[1])
    rounds = int(sys.argv[2])
    use_netns, _ = netns.available()
    c = LocalCluster(
        hosts=2, use_netns=use_netns, extra={"tcp-streams": "4", "version-timeout-s": "600"}
    )
    c.start()
    c.wait_joined()
    if link:
        c.net.shape(0, link)
    try:
        for r in range(rounds):
            for sep in (False,):
                for dens in (True, False):
                    DENS = dens
                    d, n, s, ok = one(c, 1e-6, f"p{r}{int(dens)}", sep)
                    gc.collect()
                    print(
                        f"round {r} density-before-publish {dens}: delta {d:.3f} "
                        f"dense {n:.3f} speedup {n / d:.2f} scan {s:.3f} verified {ok}",
                        flush=True,
                    )
    finally:
        c.stop()
