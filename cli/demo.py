"""`weightwire demo`: a real weight sync on a local cluster, every byte verified.

Starts daemons (real processes), trainer ranks and engine ranks (each its own
process), syncs a synthetic Qwen3-style model for several versions, verifies every
destination byte, prints a table, and stops everything cleanly.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import subprocess
import sys
import time
from typing import Any

from weightwire.client.status import fetch
from weightwire.harness import netns, synthetic
from weightwire.harness.localcluster import LocalCluster
from weightwire.harness.ranks import Rank


def _bar(frac: float, width: int = 30) -> str:
    full = int(frac * width)
    return "█" * full + "░" * (width - full)


def run(args: Any) -> int:
    model = synthetic.qwen3_of_size(args.model_gb)
    model_bytes = sum(t.numel for t in model) * 2
    use_netns = {"on": True, "off": False}.get(args.netns)
    if use_netns is None:
        use_netns = netns.available()[0]
    hosts = max(2, args.daemons)
    trainer_hosts = list(range(max(1, hosts // 2)))
    engine_hosts = list(range(len(trainer_hosts), hosts))
    print("weightwire demo: a real weight sync on a local cluster")
    cluster = LocalCluster(hosts=hosts, use_netns=use_netns)
    ranks: list[Rank] = []
    ok = False
    try:
        cluster.start()
        cluster.wait_joined()
        where = "network namespaces over veth" if use_netns else "loopback"
        print(f"  {hosts} daemons on {where} (logs in {cluster.workdir}, removed if all goes well)")
        for d in cluster.daemons:
            roles = []
            if d.host in trainer_hosts:
                roles.append("trainers")
            if d.host in engine_hosts:
                roles.append("engines")
            coord = " coordinator," if d.host == 0 else ""
            print(f"    {d.node}:{coord} {d.endpoint}, serving {' and '.join(roles)}")
        layers = sum(1 for t in model if t.name.endswith("q_proj.weight"))
        print(
            f"  model: synthetic Qwen3-style, {layers} layers, {len(model)} tensors, "
            f"{model_bytes / 1e9:.2f} GB bf16"
        )
        print(
            f"  {args.trainers} trainer ranks (FSDP, dim-0 shards) -> {args.engines} engine ranks "
            f"(TP: column-parallel sliced, the rest whole)"
        )

        def spawn(role: str, rank: int, world: int, host: int) -> Rank:
            d = cluster.daemons[host]
            cmd = [
                *cluster.prefix(host),
                sys.executable,
                "-m",
                "weightwire.cli.demo_rank",
                role,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--socket",
                d.socket,
                "--model-gb",
                str(args.model_gb),
                "--delta",
                args.delta,
                "--density",
                str(args.delta_density),
            ]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=cluster.rank_env(),
            )
            r = Rank(role, rank, proc)
            r.start_reader()
            return r

        engines = [
            spawn("engine", e, args.engines, engine_hosts[e % len(engine_hosts)])
            for e in range(args.engines)
        ]
        trainers = [
            spawn("trainer", r, args.trainers, trainer_hosts[r % len(trainer_hosts)])
            for r in range(args.trainers)
        ]
        ranks = engines + trainers
        t0 = time.monotonic()
        for r in ranks:
            r.next(300)
        print(f"  {len(ranks)} rank processes registered in {time.monotonic() - t0:.1f} s")
        rows = []
        total_verified = 0
        first_resources: dict[str, tuple[int, int]] = {}
        for v in range(1, args.versions + 1):
            for t in trainers:
                t.send(cmd="prepare", version=v)
            for t in trainers:
                t.next(600)
            for e in engines:
                e.send(cmd="verify", version=v)
            start = time.monotonic()
            for t in trainers:
                t.send(cmd="publish", version=v)
            published = _collect(trainers, engines, cluster, engine_hosts, v)
            sync_s = time.monotonic() - start
            verified = [e.next(600) for e in engines]
            errors = [ev for ev in published + verified if ev["event"] == "error"]
            if errors:
                raise RuntimeError(f"version {v} failed: {errors}")
            bad = [ev for ev in verified if not ev["ok"]]
            landed = sum(ev["landed_bytes"] for ev in verified)
            rows.append((v, sync_s, landed, all(not b for b in bad), len(verified), published))
            if bad:
                raise RuntimeError(f"version {v}: destination bytes differ: {bad}")
            total_verified += sum(ev["bytes"] for ev in verified)
            if v == 1:
                first_resources = _resources(cluster)
        last_resources = _resources(cluster)
        print()
        print(
            f"  {'version':>7}  {'sync s':>8}  {'GB moved':>9}  {'of dense':>8}  {'kind':>5}  "
            f"{'density':>7}  {'slowest rank s':>14}  verified"
        )
        for v, sync_s, landed, good, n, published in rows:
            slowest = max(ev["seconds"] for ev in published)
            moved = sum(ev["bytes"] for ev in published)
            delta = sum(ev.get("delta_bytes", 0) for ev in published)
            density = max(ev.get("density", 0.0) for ev in published)
            kind = "delta" if delta > 64 << 10 else "dense"
            print(
                f"  {v:>7}  {sync_s:>8.3f}  {moved / 1e9:>9.3f}  {moved / landed:>8.3f}  "
                f"{kind:>5}  {density:>7.4f}  {slowest:>14.3f}  "
                f"{'ok' if good else 'MISMATCH'} ({n}/{n} engine ranks)"
            )
        if args.versions > 10 or args.resources:
            print()
            print("  daemon resources, after version 1 -> after the last version:")
            for node, (rss, fds) in first_resources.items():
                rss2, fds2 = last_resources[node]
                print(
                    f"    resources {node}: rss {rss / 1e6:.1f} MB -> {rss2 / 1e6:.1f} MB, "
                    f"open fds {fds} -> {fds2}"
                )
        ok = True
    finally:
        for r in ranks:
            with contextlib.suppress(BrokenPipeError, OSError):
                r.send(cmd="quit")
        for r in ranks:
            try:
                r.proc.wait(30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
        codes = cluster.stop()
    clean = all(c == 0 for c in codes)
    if not clean:
        print(f"  daemons exited with {codes} (logs in {cluster.workdir})")
    if ok and clean:
        shutil.rmtree(cluster.workdir, ignore_errors=True)  # logs and keys kept only on failure
        print(
            f"verified {args.versions} versions, {total_verified} bytes "
            f"({total_verified / 1e9:.2f} GB) across {args.engines} engine ranks: every "
            f"destination byte bitwise equal; {hosts} daemons stopped cleanly"
        )
        return 0
    return 1


def _collect(
    trainers: list[Rank],
    engines: list[Rank],
    cluster: LocalCluster,
    engine_hosts: list[int],
    version: int,
) -> list[dict[str, Any]]:
    """Wait for every trainer's reply, drawing a progress bar from the engine daemons."""
    results: dict[int, dict[str, Any]] = {}
    tty = sys.stdout.isatty()
    last_print = 0.0
    deadline = time.monotonic() + 600
    while len(results) < len(trainers):
        for t in trainers:
            if t.rank in results:
                continue
            try:
                ev = t.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if ev["event"] in ("exit", "fatal"):
                raise RuntimeError(f"trainer rank {t.rank} stopped: {ev}")
            results[t.rank] = ev
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"version {version} did not finish in 600 s")
        if now - last_print >= (0.2 if tty else 2.0):
            last_print = now
            frac = _progress(cluster, engine_hosts, version)
            line = f"  v{version} {_bar(frac)} {frac:6.1%} landed at the engines"
            print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
    line = f"  v{version} {_bar(1.0)} 100.0% landed at the engines"
    print("\r" + line if tty else line, flush=True)
    return [results[t.rank] for t in trainers]


def _resources(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    out = {}
    for d in cluster.daemons:
        s = fetch(d.socket)
        out[d.node] = (int(s["rss_bytes"]), int(s["open_fds"]))
    return out


def _progress(cluster: LocalCluster, engine_hosts: list[int], version: int) -> float:
    fracs = []
    for h in engine_hosts:
        try:
            s = fetch(cluster.daemons[h].socket, timeout_s=2)
        except Exception:
            continue
        for r in s["receiving"]:
            if r["last_complete"] >= version:
                fracs.append(1.0)
                continue
            cur = [i["fraction"] for i in r["in_progress"] if i["version"] in (version, None)]
            fracs.append(max(cur) if cur else 0.0)
    return sum(fracs) / len(fracs) if fracs else 0.0
