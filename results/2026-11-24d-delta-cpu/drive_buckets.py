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
common = dict(kv.split("=", 1) for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 else {}
use_netns, _ = netns.available()
rng = np.random.default_rng(0)
A, B = {}, {}
for i in range(LAYERS):
    w = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * 0.02
    A[f"layers.{i}.weight"] = torch.from_numpy(w).to(torch.bfloat16)
    b = A[f"layers.{i}.weight"].clone()
    v = b.view(torch.int16).numpy().reshape(-1)
    v[rng.random(v.size, dtype=np.float32) < DENSITY] ^= 1
    B[f"layers.{i}.weight"] = b
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
            dense_timeline = bd._phases(dn, w1, eng)
            rows.append(
                (d.total_seconds, dn.total_seconds, phases, timeline, ok, d.nbytes, dense_timeline)
            )
    med = statistics.median
    print("load average", os.getloadavg(), flush=True)
    for cfg, _cl, _tr, _eng, _dst, _v, rows in setups:
        out = {
            "delta_s": med(r[0] for r in rows),
            "dense_s": med(r[1] for r in rows),
            "speedup": med(r[1] for r in rows) / med(r[0] for r in rows),
            **{k: med(r[2][k] for r in rows) for k in ("sample", "scan", "encode")},
            **{
                k: med(r[3][k] for r in rows)
                for k in ("pack", "last_landed", "after_landed", "engine_early", "engine_tail")
            },
            "after_pack": med(r[3]["total"] - r[3]["pack"] for r in rows),
            "dense_after_pack": med(r[6]["total"] - r[6]["pack"] for r in rows),
            "delta_mb": med(r[5] for r in rows) / 1e6,
            "verified": all(r[4] for r in rows),
            "delta_s_each": [round(r[0], 3) for r in rows],
            "dense_s_each": [round(r[1], 3) for r in rows],
            "pack_each": [round(r[3]["pack"], 3) for r in rows],
            "after_pack_each": [round(r[3]["total"] - r[3]["pack"], 3) for r in rows],
        }
        print(cfg, {k: round(x, 4) if isinstance(x, float) else x for k, x in out.items()},
              flush=True)  # fmt: skip
finally:
    for s in setups:
        if len(s) > 2:
            s[2].close()
            s[3].close()
        s[1].stop()
