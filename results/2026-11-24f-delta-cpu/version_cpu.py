"""The bench's own run (`bench.delta.run_lr`, lr 1e-6, 10 Gbit/s) with, per delta version,
its time, the sender's pack, the CPU seconds of the publishing thread and of this process
(trainer and engine rank), and the VM's ticks by kind (/proc/stat, 100 Hz) over it.

    .venv/bin/python results/2026-11-24f-delta-cpu/version_cpu.py [STEPS]
"""

from __future__ import annotations

import os
import sys
import time
import types
from typing import Any

import torch

import weightwire.bench.delta as bd
from weightwire.client import trainer as trmod
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

_publish = trmod.Trainer.publish


def ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def publish(self: Any, version: int, *args: Any, **kwargs: Any) -> Any:
    delta = self.delta is not None and self.delta.mode == "auto"
    s0, t0, p0 = ticks(), time.thread_time(), os.times()
    d = _publish(self, version, *args, **kwargs)
    s1, t1, p1 = ticks(), time.thread_time(), os.times()
    if delta:
        diff = [b - a for a, b in zip(s0, s1, strict=True)]
        user, _, system, idle, _, irq, softirq, steal = diff[:8]
        proc = (p1.user + p1.system) - (p0.user + p0.system)
        print(
            f"v{version}: {d.total_seconds:.3f} s, pack {d.pack_seconds:.3f}, sender CPU "
            f"{t1 - t0:.3f}, process CPU {proc:.3f}; ticks user {user} sys {system} idle "
            f"{idle} irq {irq} softirq {softirq} steal {steal}",
            flush=True,
        )
    return d


def main() -> None:
    trmod.Trainer.publish = publish  # type: ignore[method-assign]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    use_netns, why = netns.available()
    if not use_netns:
        raise SystemExit(f"needs network namespaces: {why}")
    cl = LocalCluster(hosts=2, use_netns=True, extra={"version-timeout-s": "600"})
    cl.start()
    cl.wait_joined()
    try:
        assert cl.net is not None
        cl.net.shape(0, 10.0)
        steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
        args = types.SimpleNamespace(layers=8, width=8192, steps=steps)
        bd.run_lr(cl, 1e-6, args, "version-cpu")
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
