"""The bench's own `run_lr` (lr 1e-6, 3 AdamW steps, unshaped veth), twice per process,
called from a plain script: how much one delta version's time varies between runs in
the same conditions on the shared 2-core VM. `run_lr.txt` holds what it printed.

    [OMP_WAIT_POLICY=passive] .venv/bin/python results/2026-11-24c-delta-cpu/run_lr.py LABEL
"""

from __future__ import annotations

import sys
import types

import weightwire.bench.delta as bd
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

label = sys.argv[1]  # "setthreads" in it: torch.set_num_threads first, as the bench does
if "setthreads" in label:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
use_netns, _ = netns.available()
cluster = LocalCluster(
    hosts=2, use_netns=use_netns, extra={"tcp-streams": "4", "version-timeout-s": "600"}
)
args = types.SimpleNamespace(layers=8, width=8192, steps=3, lr=[1e-6], link_gbps=[], streams=4)
try:
    cluster.start()
    cluster.wait_joined()
    for i in range(2):
        r = bd.run_lr(cluster, 1e-6, args, f"run-{i}")
        t = r["timeline_s"]["delta"]
        print(
            label, i, "delta", r["delta_s"], "dense", r["dense_s"], r["delta_phases_s"],
            "pack", t["pack"], flush=True,
        )  # fmt: skip
finally:
    cluster.stop()
