"""Delta against dense with different plan bucket sizes, alternated in one process.

As `../2026-11-24c-delta-cpu/drive.py` (two daemons in namespaces, tcp, 4 streams, a
trainer and an engine rank here, 8 x 8192^2 bf16 = 1.07 GB, versions alternating between
A and B = A with the low bit of 4.2 % of its elements flipped), but one cluster per bucket
size, all up at once, and the sizes taken in turn, round after round, so each sees the
same load. Every version is checked bitwise. Prints medians per bucket size.

    .venv/bin/python results/2026-11-24d-delta-cpu/drive_buckets.py \
        LINK_GBPS|none MIB,MIB,.. ROUNDS [FLAG=V,..]

FLAG=V: more daemon flags for every cluster; a size written `256+bucket-tail-bytes=0`
gives that cluster its own flags, and `+sample` samples every slot before its compare
(`sender.SKIP_FILL` off, as before). DENSITY (environment): of B's elements flipped.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

import weightwire.bench.delta as bd
from weightwire.client import Engine, Trainer
from weightwire.client.delta import sender
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

LAYERS, WIDTH = 8, 8192
DENSITY = float(os.environ.get("DENSITY", "0.042"))  # of the elements flipped in B
link = None if sys.argv[1] == "none" else float(sys.argv[1])
configs = sys.argv[2].split(",")
rounds = int(sys.argv[3])
TIMELINE = ("pack", "last_landed", "after_landed", "engine_early", "engine_tail")
common = dict(kv.split("=", 1) for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 else {}
use_netns, _ = netns.available()


def pair(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's A (std 0.02) and B (A, the low bit of DENSITY of its elements flipped)."""
    a = torch.from_numpy(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * 0.02)
    a = a.to(torch.bfloat16)
    flip = torch.from_numpy(rng.random(WIDTH * WIDTH, dtype=np.float32) < DENSITY)
    b = a.clone()
    b.view(torch.int16).view(-1).bitwise_xor_(flip.to(torch.int16))
    return a, b


gen = np.random.default_rng(0)
A, B = {}, {}
for i in range(LAYERS):
    A[f"layers.{i}.weight"], B[f"layers.{i}.weight"] = pair(gen)
params = {n: t.clone() for n, t in A.items()}

setups = []
try:
    for cfg in configs:
        mib, *more = (x for x in cfg.split("+") if x != "sample")
        flags = {"tcp-streams": "4", "version-timeout-s": "600", **common}
        flags["bucket-bytes"] = str(int(float(mib) * (1 << 20)))
        flags.update(dict(kv.split("=", 1) for kv in more))
        cl = LocalCluster(hosts=2, use_netns=use_netns, extra=flags)
        setups.append([cfg, cl])
        cl.start()
        cl.wait_joined()
        if link:
            assert cl.net is not None
            cl.net.shape(0, link)
        dst = {n: torch.zeros_like(t) for n, t in params.items()}
        eng = Engine(0, 1, socket=cl.daemons[1].socket, job=f"b{cfg}", timeout_s=600,
                     delta_area=0.25)  # fmt: skip
        eng.register(dst)
        tr = Trainer(0, 1, socket=cl.daemons[0].socket, job=f"b{cfg}", timeout_s=600,
                     delta="auto")  # fmt: skip
        tr.register(params)
        tr.prepare()
        tr.publish(0)
        eng.wait(0)
        print(cfg, "buckets", [b.nbytes for b in tr.plan().buckets], flush=True)
        setups[-1] += [tr, eng, dst, 0, []]
    for r in range(rounds):
        for n in params:
            params[n].copy_((B if r % 2 == 0 else A)[n])
        for s in setups:
            cfg, cl, tr, eng, dst, v, rows = s
            v += 1
            sender.SKIP_FILL = -1.0 if "+sample" in cfg else 0.5
            tr.delta.mode = "auto"
            w0 = time.time()
            d = tr.publish(v)
            eng.wait(v)
            phases, timeline = dict(tr.delta.phases), bd._phases(d, w0, eng)
            ok = all(torch.equal(dst[n], params[n]) for n in params)
            v += 1
            tr.delta.mode = "off"
            w1 = time.time()
            dn = tr.publish(v)
            eng.wait(v)
            ok &= all(torch.equal(dst[n], params[n]) for n in params)
            s[5] = v
            late = bd._phases(dn, w1, eng)
            rows.append(
                {
                    "delta_s": d.total_seconds,
                    "dense_s": dn.total_seconds,
                    **{k: phases[k] for k in ("sample", "scan", "encode")},
                    **{k: timeline[k] for k in TIMELINE},
                    "after_pack": timeline["total"] - timeline["pack"],
                    "dense_after_pack": late["total"] - late["pack"],
                    "delta_mb": d.nbytes / 1e6,
                    "ok": ok,
                }
            )
    print("load average", os.getloadavg(), flush=True)
    for cfg, _cl, _tr, _eng, _dst, _v, rows in setups:
        out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "ok"}
        out["speedup"] = out["dense_s"] / out["delta_s"]
        out["verified"] = all(r["ok"] for r in rows)
        for k in ("delta_s", "dense_s", "pack", "after_pack"):
            out[f"{k}_each"] = [round(r[k], 3) for r in rows]
        print(cfg, {k: round(x, 4) if isinstance(x, float) else x for k, x in out.items()},
              flush=True)  # fmt: skip
finally:
    for s in setups:
        if len(s) > 2:
            s[2].close()
            s[3].close()
        s[1].stop()
