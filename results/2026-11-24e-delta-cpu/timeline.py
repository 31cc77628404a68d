"""Where a delta version's end goes, at the engine: the time of each ApplyBucket and
ApplyVersion (arrival `>`, done `<`) and of the trainer's TrailersReady, from the publish
call, for versions alternating between A and B (B: A with the low bit of 4.2 % of its
elements flipped), 8 x 8192^2 bf16, two daemons in namespaces, tcp, veth shaped to 10
Gbit/s. Every version checked bitwise.

    .venv/bin/python results/2026-11-24e-delta-cpu/timeline.py [VERSIONS]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch

from weightwire.client import Engine, Trainer, notices
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.local import TrailersReady

LOG: list[tuple[float, str, int]] = []
_notify = notices.VersionNotices.notify


def notify(self: Any, msg: Any) -> None:
    kind = type(msg).__name__
    timed = kind in ("ApplyBucket", "ApplyVersion")
    if timed:
        LOG.append((time.perf_counter(), kind + ">", getattr(msg, "bucket", -1)))
    _notify(self, msg)
    if timed:
        LOG.append((time.perf_counter(), kind + "<", getattr(msg, "bucket", -1)))


notices.VersionNotices.notify = notify  # type: ignore[method-assign]


def pair(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.from_numpy(rng.standard_normal((8192, 8192), dtype=np.float32) * 0.02)
    a = a.to(torch.bfloat16)
    flip = torch.from_numpy(rng.random(8192 * 8192, dtype=np.float32) < 0.042)
    b = a.clone()
    b.view(torch.int16).view(-1).bitwise_xor_(flip.to(torch.int16))
    return a, b


def main() -> None:
    versions = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rng = np.random.default_rng(0)
    a_b = [pair(rng) for _ in range(8)]
    params = {f"l{i}": a.clone() for i, (a, _) in enumerate(a_b)}
    use_netns, _ = netns.available()
    flags = {"tcp-streams": "4", "version-timeout-s": "600"}
    cl = LocalCluster(hosts=2, use_netns=use_netns, extra=flags)
    cl.start()
    cl.wait_joined()
    try:
        if cl.net is not None:
            cl.net.shape(0, 10.0)
        dst = {n: torch.zeros_like(t) for n, t in params.items()}
        eng = Engine(0, 1, socket=cl.daemons[1].socket, job="t", timeout_s=600, delta_area=0.25)
        eng.register(dst)
        tr = Trainer(0, 1, socket=cl.daemons[0].socket, job="t", timeout_s=600, delta="auto")
        tr.register(params)
        tr.prepare()
        tr.publish(0)
        eng.wait(0)
        send = tr._conn.send

        def timed_send(msg: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(msg, TrailersReady):
                LOG.append((time.perf_counter(), "TrailersReady", -1))
            return send(msg, *args, **kwargs)

        tr._conn.send = timed_send  # type: ignore[method-assign]
        for v in range(1, versions + 1):
            for i, (a, b) in enumerate(a_b):
                params[f"l{i}"].copy_(b if v % 2 else a)
            LOG.clear()
            t0 = time.perf_counter()
            d = tr.publish(v)
            eng.wait(v)
            assert all(torch.equal(dst[n], params[n]) for n in params)
            print(f"v{v} total {d.total_seconds * 1e3:.1f} ms, pack {d.pack_seconds * 1e3:.1f}")
            marks = (f"{k}{b if b >= 0 else ''}@{(t - t0) * 1e3:.1f}" for t, k, b in LOG)
            print("   ", " ".join(marks))
        tr.close()
        eng.close()
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
