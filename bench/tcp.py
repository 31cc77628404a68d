"""`weightwire bench tcp`: daemon-to-daemon throughput over veth, beside iperf3.

Two hosts (network namespaces joined by veth), a daemon on each, a trainer rank on
one and an engine rank on the other. In the same run, iperf3 with the same number of
streams over the same link. Rounds alternate (iperf3, weightwire, ...) so both see
the same machine; medians are reported, with their ratio.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def iperf3(cluster: Any, streams: int, seconds: float) -> float:
    """Gbit/s received, iperf3 client on host 0, server on host 1."""
    port = "5201"
    server = subprocess.Popen(
        [*cluster.prefix(1), "iperf3", "-s", "-1", "-p", port],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [
                *cluster.prefix(0),
                "iperf3",
                "-c",
                cluster.address(1),
                "-p",
                port,
                "-P",
                str(streams),
                "-t",
                str(seconds),
                "-J",
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
        report = json.loads(out.stdout)
        if "error" in report:
            raise RuntimeError(f"iperf3: {report['error']}")
        return float(report["end"]["sum_received"]["bits_per_second"]) / 1e9
    finally:
        server.wait(10)


def run(args: Any) -> int:
    import torch

    from weightwire.client import Engine, Trainer
    from weightwire.harness import netns
    from weightwire.harness.localcluster import LocalCluster

    ok, why = netns.available()
    if not ok:
        print(f"bench tcp needs network namespaces: {why}", file=sys.stderr)
        return 2
    if shutil.which("iperf3") is None:
        print("bench tcp needs iperf3 (apt-get install iperf3)", file=sys.stderr)
        return 2
    nbytes = int(args.gb * 1e9) // MiB * MiB
    flags = {"tcp-streams": str(args.streams), "max-write-bytes": str(16 * MiB)}
    cluster = LocalCluster(hosts=2, use_netns=True, extra=flags)
    results: dict[str, list[float]] = {"weightwire": [], "iperf3": []}
    try:
        cluster.start()
        cluster.wait_joined()
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        eng = Engine(0, 1, socket=cluster.daemons[1].socket, job="bench")
        eng.register({"blob": dst})
        tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job="bench")
        tr.register({"blob": src})
        tr.prepare()
        tr.publish(0)  # warm: connections up, pages touched
        eng.wait(0)
        for i in range(args.rounds):
            results["iperf3"].append(iperf3(cluster, args.streams, args.seconds))
            s = tr.publish(i + 1)
            eng.wait(i + 1)
            results["weightwire"].append(s.nbytes * 8 / s.transfer_seconds / 1e9)
        if not torch.equal(src, dst):
            print("destination bytes differ from the source", file=sys.stderr)
            return 1
        tr.close()
        eng.close()
    finally:
        cluster.stop()
    ww = statistics.median(results["weightwire"])
    ip = statistics.median(results["iperf3"])
    report = {
        "weightwire_gbps": round(ww, 3),
        "iperf3_gbps": round(ip, 3),
        "ratio": round(ww / ip, 3),
        "streams": args.streams,
        "bytes_per_round": nbytes,
        "rounds": args.rounds,
        "weightwire_rounds_gbps": [round(x, 3) for x in results["weightwire"]],
        "iperf3_rounds_gbps": [round(x, 3) for x in results["iperf3"]],
        "link": "veth between two network namespaces (same machine)",
        "verified": True,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"weightwire {ww:.2f} Gbit/s vs iperf3 {ip:.2f} Gbit/s with {args.streams} streams "
            f"over veth: ratio {ww / ip:.2f} (medians of {args.rounds} alternating rounds; "
            f"{nbytes / 1e9:.2f} GB per weightwire round, bytes verified)"
        )
    return 0
