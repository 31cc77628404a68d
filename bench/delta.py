"""`weightwire bench delta`: sparse delta sync against dense, in the same run, on CPU.

Two daemons (network namespaces joined by veth as root, loopback otherwise), a trainer
rank and an engine rank with a delta area. The model is a stack of linear layers
(`--layers` x `--width`^2 parameters, 0.54 B by default) at its init scale (std 0.02),
trained by real AdamW steps on fp32 master weights (a regression loss on random data);
its bf16 parameters, cast from the masters after every step, are what is published.

For each learning rate, every step is published twice: first as a delta (against the
previous step, which the engine holds), then dense (the same weights again, every byte),
so both are measured on the same machine at the same moment. Every publish is checked
bitwise against the trainer's bf16 weights. Reported per learning rate: the measured
density (changed bf16 elements), bytes moved, publish times (the trainer's call, from
packing to verified at the engine) and their ratios, medians over the steps; the
density is counted exactly here (the sender's own figure, `sender_densities`, is
estimated from samples where a bucket went dense without a full compare), and
`delta_phases_s` splits the sender's delta work by phase (sample, scan, copy, encode).

Two links by default, each learning rate on each, in the same process: first unshaped
veth, then (where network namespaces are available) the trainer host's veth shaped to 10
Gbit/s by `tc` (a token bucket), as a NIC of that rate would send. The report's `runs`
(one per learning rate) are the shaped link's: the issue's "tcp" is a network, where the
bytes saved are time saved. The unshaped veth runs are kept beside them
(`unshaped_runs`): veth moves bytes at memory speed on one machine, so a dense publish
there is a memory copy (~0.5 s per 1.07 GB on the 2-core development VM) and a delta's
own memory traffic caps its speedup (~3x here) whatever the bytes saved. Without
namespaces (loopback), or with `--unshaped-only`, `runs` are the unshaped ones and
`unshaped_runs` is empty. `--link-gbps R ...` picks the shaped rates (`runs` then hold
each rate's, in order); each run says its link (`link_gbps`: null unshaped).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from typing import Any

MiB = 1 << 20


class Model:
    """Linear layers with fp32 masters, AdamW, and the bf16 parameters that get published."""

    def __init__(self, layers: int, width: int, lr: float, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.master = [
            torch.nn.Parameter(torch.randn(width, width, generator=g) * 0.02) for _ in range(layers)
        ]
        self.bf16 = {
            f"layers.{i}.weight": m.detach().to(torch.bfloat16) for i, m in enumerate(self.master)
        }
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0, foreach=False)
        self.x = torch.randn(8, width, generator=g)
        self.y = torch.randn(8, width, generator=g) * 0.1
        self.width = width

    @property
    def params(self) -> int:
        return sum(m.numel() for m in self.master)

    def step(self) -> float:
        import torch

        h = self.x
        for m in self.master:
            h = torch.tanh(h @ m.T) if m is not self.master[-1] else h @ m.T
        loss = torch.nn.functional.mse_loss(h, self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            for (_, p), m in zip(self.bf16.items(), self.master, strict=True):
                p.copy_(m)  # in place: the trainer reads these tensors
        return float(loss.detach())


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def _density(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Changed elements / elements, bitwise (bf16 as int16), exact."""
    import torch

    changed = total = 0
    for n, a in after.items():
        changed += int((a.view(torch.int16) != before[n].view(torch.int16)).sum())
        total += a.numel()
    return changed / total if total else 0.0


def _phases(stats: Any, w0: float, eng: Any) -> dict[str, float]:
    """Where one publish's time went (seconds from the publish call): the daemon accepting
    the version, the sender's last bucket posted (compare, encode, post; `pack`: its
    busy part), the last bucket landed, and the rest (trailers, the engine's last check,
    the verdict back); the engine's work on buckets before the end (`engine_early`) and at
    it (`engine_tail`); ring slots the sender waited for (`slot_waits`)."""
    posted = max((b.prepared for b in stats.buckets), default=w0) - w0
    landed = max((b.landed for b in stats.buckets), default=w0) - w0
    rx = eng.delta
    return {
        "begin": stats.begin_seconds,
        "pack": stats.pack_seconds,
        "last_posted": posted,
        "last_landed": landed,
        "after_landed": stats.total_seconds - landed,
        "total": stats.total_seconds,
        "engine_early": rx.early_s if rx is not None else 0.0,
        "engine_tail": rx.tail_s if rx is not None else 0.0,
        "slot_waits": float(stats.slot_landings + stats.slot_events),
    }


def run_lr(cluster: Any, lr: float, args: Any, job: str) -> dict[str, Any]:
    import torch

    from weightwire.client import Engine, Trainer

    model = Model(args.layers, args.width, lr)
    dst = {n: torch.zeros_like(t) for n, t in model.bf16.items()}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=600, delta_area=0.25)
    eng.register(dst)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=600, delta="auto")
    tr.register(model.bf16)
    tr.prepare()
    version = 0
    tr.publish(version)  # warm-up, dense: connections, pages, and the shadow
    eng.wait(version)
    verified = _bitwise(dst, model.bf16)
    rows = []
    phases: list[dict[str, float]] = []
    timing: dict[str, list[dict[str, float]]] = {"delta": [], "dense": []}
    exact: list[float] = []
    for _ in range(args.steps):
        before = {n: t.clone() for n, t in model.bf16.items()}
        t0 = time.perf_counter()
        loss = model.step()
        step_s = time.perf_counter() - t0
        version += 1
        tr.delta.mode = "auto"
        w0 = time.time()
        delta = tr.publish(version)
        phases.append(dict(tr.delta.phases))
        eng.wait(version)
        timing["delta"].append(_phases(delta, w0, eng))
        verified &= _bitwise(dst, model.bf16)
        version += 1
        tr.delta.mode = "off"
        w0 = time.time()
        dense = tr.publish(version)
        eng.wait(version)
        timing["dense"].append(_phases(dense, w0, eng))
        verified &= _bitwise(dst, model.bf16)
        # the bench's own count, after the publishes it would otherwise slow (its torch
        # temporaries and threads made the next publish up to 0.05 s slower here)
        exact.append(_density(before, model.bf16))
        del before
        rows.append((delta, dense, loss, step_s))
    tr.close()
    eng.close()
    del model, dst, tr, eng
    med = statistics.median
    density = med(exact)
    dense_bytes = med(n.nbytes for _, n, _, _ in rows)
    delta_bytes = med(d.nbytes for d, _, _, _ in rows)
    dense_s = med(n.total_seconds for _, n, _, _ in rows)
    delta_s = med(d.total_seconds for d, _, _, _ in rows)
    return {
        "lr": lr,
        "density": round(density, 5),
        "dense_bytes": int(dense_bytes),
        "delta_bytes": int(delta_bytes),
        "bytes_ratio": round(delta_bytes / dense_bytes, 5),
        "bytes_ratio_over_density": round(delta_bytes / dense_bytes / density, 3)
        if density
        else None,
        "dense_s": round(dense_s, 4),
        "delta_s": round(delta_s, 4),
        "speedup": round(dense_s / delta_s, 3),
        "delta_s_each": [round(d.total_seconds, 4) for d, _, _, _ in rows],
        "dense_s_each": [round(n.total_seconds, 4) for _, n, _, _ in rows],
        "dense_transfer_s": round(med(n.transfer_seconds for _, n, _, _ in rows), 4),
        "delta_transfer_s": round(med(d.transfer_seconds for d, _, _, _ in rows), 4),
        "delta_pack_s": round(med(d.pack_seconds for d, _, _, _ in rows), 4),
        "dense_pack_s": round(med(n.pack_seconds for _, n, _, _ in rows), 4),
        "steps": args.steps,
        "densities": [round(x, 5) for x in exact],
        "sender_densities": [round(d.density, 5) for d, _, _, _ in rows],
        "delta_phases_s": {k: round(med(p.get(k, 0.0) for p in phases), 4) for k in phases[0]}
        if phases
        else {},
        "timeline_s": {
            kind: {k: round(med(t[k] for t in ts), 4) for k in ts[0]}
            for kind, ts in timing.items()
            if ts
        },
        "losses": [round(x, 6) for _, _, x, _ in rows],
        "adamw_step_s": round(med(s for _, _, _, s in rows), 3),
        "verified": bool(verified),
    }


def run(args: Any) -> int:
    import torch

    from weightwire.harness import netns
    from weightwire.harness.localcluster import LocalCluster

    torch.set_num_threads(max(1, torch.get_num_threads()))
    use_netns, why = netns.available()
    from weightwire.daemon.config import default_tcp_streams

    streams = args.streams or default_tcp_streams()  # the daemon's default unless given
    flags = {"tcp-streams": str(streams), "version-timeout-s": "600"}
    cluster = LocalCluster(hosts=2, use_netns=use_netns, extra=flags)
    runs = []
    params = args.layers * args.width * args.width
    shaped = links_of(args, use_netns)
    links: list[float | None] = [None, *shaped]
    if shaped and not use_netns:
        raise SystemExit(f"--link-gbps shapes the namespaces' veth with tc: {why}")
    try:
        cluster.start()
        cluster.wait_joined()
        for link in links:
            if link is not None:
                assert cluster.net is not None
                cluster.net.shape(0, link)
            for lr in args.lr:
                r = run_lr(cluster, lr, args, f"delta-bench-{len(runs)}")
                gc.collect()  # the last run's model, optimizer and regions, before the next
                r["link_gbps"] = link
                runs.append(r)
                if args.json:
                    continue
                where = "veth" if link is None else f"veth shaped to {link:g} Gbit/s"
                print(
                    f"{where}, lr {lr:g}: density {r['density']:.4f}, "
                    f"bytes {r['delta_bytes'] / 1e6:.1f} MB "
                    f"vs {r['dense_bytes'] / 1e6:.1f} MB (ratio {r['bytes_ratio']:.4f}), "
                    f"publish {r['delta_s']:.3f} s vs {r['dense_s']:.3f} s "
                    f"(speedup {r['speedup']:.2f}), verified {r['verified']}",
                    flush=True,
                )
    finally:
        cluster.stop()
    nic = [r for r in runs if r["link_gbps"] is not None]
    report = {
        "params": params,
        "dtype": "bfloat16 (fp32 master weights, AdamW)",
        "link": "veth between two network namespaces" if use_netns else f"loopback ({why})",
        "link_gbps": shaped,  # shaped runs (tc tbf on the trainer host's veth)
        "transport": "tcp",
        "streams": streams,
        "runs": nic or runs,
        "unshaped_runs": [r for r in runs if r["link_gbps"] is None] if nic else [],
        "verified": all(r["verified"] for r in runs),
    }
    if args.json:
        print(json.dumps(report))
    return 0 if report["verified"] else 1


DEFAULT_LINKS_GBPS = [10.0]
"""Shaped runs by default, after the unshaped one, where namespaces are available."""


def links_of(args: Any, use_netns: bool) -> list[float]:
    """The shaped link rates to run (Gbit/s), after the unshaped run."""
    if args.unshaped_only:
        return []
    if args.link_gbps is None:
        return list(DEFAULT_LINKS_GBPS) if use_netns else []
    return list(args.link_gbps)


def add_arguments(p: Any) -> None:
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.add_argument("--layers", type=int, default=8, help="square linear layers of the model")
    p.add_argument("--width", type=int, default=8192, help="8 x 8192^2 = 0.54 B parameters")
    p.add_argument(
        "--lr", type=float, nargs="+", default=[1e-6, 1e-5], help="AdamW learning rates, each a run"
    )
    p.add_argument("--steps", type=int, default=5, help="AdamW steps (versions) per learning rate")
    p.add_argument(
        "--streams",
        type=int,
        default=0,
        help="tcp streams per peer (default: the daemon's, 4 or the host's cores if fewer)",
    )
    links = p.add_mutually_exclusive_group()
    links.add_argument(
        "--link-gbps",
        type=float,
        nargs="*",
        default=None,
        metavar="GBPS",
        help="also run with the trainer host's veth shaped to each rate (Gbit/s) by tc, as a "
        "NIC of that rate (needs root; default: 10 where network namespaces are available, "
        "none otherwise; none given: unshaped only); the unshaped runs always come first",
    )
    links.add_argument(
        "--unshaped-only",
        action="store_true",
        help="only the unshaped veth (or loopback) runs, no shaped link",
    )
