"""Client-side variants of a delta version, alternated round by round in one process.

Two daemons in network namespaces, tcp, 10 Gbit/s; a trainer and an engine rank here,
8 x 8192^2 bf16 (1.07 GB), versions alternating between A and B (B: A with the low bit of
4.2 % of its elements flipped), every version checked bitwise. One cluster per variant,
all up at once, the variants taking turns. Prints each variant's delta seconds.

    .venv/bin/python results/2026-11-24g-delta-cpu/ab_client.py ROUNDS VARIANT,VARIANT..

A variant is `base` with any of: `+split1` (the version's first host bucket compared on
two threads, `hostpass.THREADS` 2, the rest on one), `+niceN` (the engine's apply threads
at nice N), `+tailM` (the daemons' `bucket-tail-bytes` M MiB), `+dense` (a dense version
after each delta one, as the bench publishes), `+unit2` (2-byte elements compared and
encoded as elements: `HostClaims.unit_of` always 2, where it would choose bytes). Prints
each variant's median and its last version's bytes moved.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
from typing import Any

import numpy as np
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.delta import hostpass, receiver, sender
from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

CURRENT = {"variant": "base"}
NICE: dict[int, int] = {}  # id(DeltaReceiver) -> nice of its apply threads
_niced: set[int] = set()
_bucket_host = sender.DeltaSender._bucket_host
_apply_bucket = receiver.DeltaReceiver._apply_bucket


def bucket_host(self: Any, *args: Any) -> Any:
    first = self._compared == 0 and self._changed == 0
    hostpass.THREADS = 2 if first and "+split1" in CURRENT["variant"] else 1
    return _bucket_host(self, *args)


def apply_bucket(self: Any, early: Any, msg: Any) -> Any:
    tid = threading.get_native_id()
    if NICE.get(id(self)) and tid not in _niced:
        os.setpriority(os.PRIO_PROCESS, tid, NICE[id(self)])
        _niced.add(tid)
    return _apply_bucket(self, early, msg)


def option(variant: str, name: str) -> int | None:
    for part in variant.split("+")[1:]:
        if part.startswith(name):
            return int(part[len(name) :])
    return None


def versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rng = np.random.default_rng(0)
    a, b = {}, {}
    for i in range(8):
        x = rng.standard_normal((8192, 8192), dtype=np.float32) * 0.02
        t = torch.from_numpy(x).to(torch.bfloat16)
        flip = torch.from_numpy(rng.random(8192 * 8192, dtype=np.float32) < 0.042)
        u = t.clone()
        u.view(torch.int16).view(-1).bitwise_xor_(flip.to(torch.int16))
        a[f"l{i}"], b[f"l{i}"] = t, u
    return a, b


def start(runs: list[dict[str, Any]], variant: str, extra: dict[str, str]) -> dict[str, Any]:
    """Two daemons in namespaces, the first's veth shaped to 10 Gbit/s, as a new run."""
    cl = LocalCluster(hosts=2, use_netns=True, extra=extra)
    run: dict[str, Any] = {"variant": variant, "cluster": cl, "times": [], "v": 0}
    runs.append(run)
    cl.start()
    cl.wait_joined()
    assert cl.net is not None
    cl.net.shape(0, 10.0)
    return run


def report(runs: list[dict[str, Any]]) -> None:
    print("load average", os.getloadavg())
    for run in runs:
        times = run["times"]
        print(run["variant"], f"median {statistics.median(times):.4f}",
              [round(x, 3) for x in times], "bytes", run.get("bytes", [0])[-1],
              flush=True)  # fmt: skip


def main() -> None:
    sender.DeltaSender._bucket_host = bucket_host  # type: ignore[method-assign]
    receiver.DeltaReceiver._apply_bucket = apply_bucket  # type: ignore[method-assign]
    rounds, variants = int(sys.argv[1]), sys.argv[2].split(",")
    use_netns, why = netns.available()
    if not use_netns:
        raise SystemExit(f"needs network namespaces: {why}")
    a, b = versions()
    params = {n: t.clone() for n, t in a.items()}
    runs: list[dict[str, Any]] = []
    try:
        for variant in variants:
            extra = {"version-timeout-s": "600"}
            tail = option(variant, "tail")
            if tail is not None:
                extra["bucket-tail-bytes"] = str(tail << 20)
            run = start(runs, variant, extra)
            cl = run["cluster"]
            dst = {n: torch.zeros_like(t) for n, t in params.items()}
            job, sock = f"ab-{len(runs)}", cl.daemons[1].socket
            eng = Engine(0, 1, socket=sock, job=job, timeout_s=600, delta_area=0.25)
            eng.register(dst)
            NICE[id(eng.delta)] = option(variant, "nice") or 0
            tr = Trainer(0, 1, socket=cl.daemons[0].socket, job=job, timeout_s=600, delta="auto")
            tr.register(params)
            tr.prepare()
            tr.publish(0)
            eng.wait(0)
            if "+unit2" in variant:
                tr.delta.host.unit_of = lambda bucket, looks: 2  # type: ignore[method-assign]
            run.update(tr=tr, eng=eng, dst=dst)
        for r in range(rounds + 1):
            for n in params:
                params[n].copy_((b if r % 2 == 0 else a)[n])
            for run in runs:
                CURRENT["variant"] = run["variant"]
                tr, eng = run["tr"], run["eng"]
                run["v"] += 1
                d = tr.publish(run["v"])
                eng.wait(run["v"])
                assert all(torch.equal(run["dst"][n], params[n]) for n in params)
                if r:  # the first round samples every slot
                    run["times"].append(d.total_seconds)
                    run.setdefault("bytes", []).append(d.nbytes)
                if "+dense" in run["variant"]:
                    tr.delta.mode, run["v"] = "off", run["v"] + 1
                    tr.publish(run["v"])
                    eng.wait(run["v"])
                    tr.delta.mode = "auto"
        report(runs)
    finally:
        for run in runs:
            if "tr" in run:
                run["tr"].close()
                run["eng"].close()
            run["cluster"].stop()


if __name__ == "__main__":
    main()
