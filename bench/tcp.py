"""`weightwire bench tcp`: daemon-to-daemon throughput over veth, beside iperf3.

Two hosts (network namespaces joined by veth), a daemon on each, a trainer rank on
one and an engine rank on the other. In the same run, iperf3 with the same number of
streams over the same link. Rounds alternate (iperf3, weightwire, ...) so both see
the same machine; medians are reported, with their ratio. Each tcp security setting
(plain, authenticated, encrypted) gets its own pair of daemons (its own namespaces), all
up at once: a round runs iperf3, then one version through each pair (in an order that
rotates from round to round), so every setting and the baseline see the same moment of a
shared machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time that processes have used so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def iperf3(cluster: Any, streams: int, seconds: float) -> tuple[float, float]:
    """(Gbit/s received, CPU seconds per GB of both ends), client on host 0, server on 1."""
    port = "5201"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
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
        server.wait(10)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        received = float(report["end"]["sum_received"]["bytes"])
        return float(report["end"]["sum_received"]["bits_per_second"]) / 1e9, cpu / (received / 1e9)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


MODES = ("off", "auth", "encrypt")  # tcp_security: plain, authenticated (default), encrypted


@dataclass
class Pair:
    """Two daemons with one `tcp_security` setting, a trainer rank and an engine rank."""

    mode: str
    cluster: Any
    trainer: Any = None
    engine: Any = None
    src: Any = None
    dst: Any = None
    gbps: list[float] = field(default_factory=list)
    cpu_per_gb: list[float] = field(default_factory=list)  # both daemons, CPU s per GB

    def start(self, nbytes: int) -> None:
        import torch

        from weightwire.client import Engine, Trainer

        self.cluster.start()
        self.cluster.wait_joined()
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.engine = Engine(0, 1, socket=self.cluster.daemons[1].socket, job="bench")
        self.engine.register({"blob": self.dst})
        self.trainer = Trainer(0, 1, socket=self.cluster.daemons[0].socket, job="bench")
        self.trainer.register({"blob": self.src})
        self.trainer.prepare()
        self.trainer.publish(0)  # warm: connections up, pages touched
        self.engine.wait(0)

    def round(self, version: int) -> None:
        pids = [d.proc.pid for d in self.cluster.daemons]
        cpu = cpu_seconds(pids)
        s = self.trainer.publish(version)
        self.engine.wait(version)
        self.cpu_per_gb.append((cpu_seconds(pids) - cpu) / (s.nbytes / 1e9))
        self.gbps.append(s.nbytes * 8 / s.transfer_seconds / 1e9)

    def stop(self) -> bool:
        """Stops everything; whether the destination holds the source's bytes."""
        import torch

        verified = self.src is not None and torch.equal(self.src, self.dst)
        for client in (self.trainer, self.engine):
            if client is not None:
                client.close()
        self.cluster.stop()
        return verified


def run(args: Any) -> int:
    from weightwire.harness import netns
    from weightwire.harness.localcluster import LocalCluster

    ok, why = netns.available()
    if not ok:
        print(f"bench tcp needs network namespaces: {why}", file=sys.stderr)
        return 2
    if shutil.which("iperf3") is None:
        print("bench tcp needs iperf3 (apt-get install iperf3)", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(f"--modes: {unknown or 'none'}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    nbytes = int(args.gb * 1e9) // MiB * MiB
    pairs = [
        Pair(
            mode,
            LocalCluster(
                hosts=2,
                use_netns=True,
                extra={
                    "tcp-streams": str(args.streams),
                    "max-write-bytes": str(16 * MiB),
                    "tcp-security": mode,
                },
            ),
        )
        for mode in modes
    ]
    iperf: list[float] = []
    iperf_cpu: list[float] = []
    verified: dict[str, bool] = {}
    try:
        for pair in pairs:
            pair.start(nbytes)
        for i in range(args.rounds):  # iperf3 and every setting once per round, in turn
            gbps, cpu = iperf3(pairs[0].cluster, args.streams, args.seconds)
            iperf.append(gbps)
            iperf_cpu.append(cpu)
            for pair in pairs[i % len(pairs) :] + pairs[: i % len(pairs)]:  # rotated
                pair.round(i + 1)
    finally:
        for pair in pairs:
            verified[pair.mode] = pair.stop()
    if not all(verified.values()):
        bad = [m for m, ok in verified.items() if not ok]
        print(f"destination bytes differ from the source ({', '.join(bad)})", file=sys.stderr)
        return 1
    ip = statistics.median(iperf)
    per_mode = {
        p.mode: {
            "weightwire_gbps": round(statistics.median(p.gbps), 3),
            "iperf3_gbps": round(ip, 3),
            "ratio": round(statistics.median(p.gbps) / ip, 3),
            "weightwire_rounds_gbps": [round(x, 3) for x in p.gbps],
            "cpu_s_per_gb": round(statistics.median(p.cpu_per_gb), 3),  # both daemons
            "verified": verified[p.mode],
        }
        for p in pairs
    }
    main = per_mode.get("auth") or next(iter(per_mode.values()))
    report = {
        "weightwire_gbps": main["weightwire_gbps"],  # the default setting (auth) when measured
        "iperf3_gbps": round(ip, 3),
        "ratio": main["ratio"],
        "modes": per_mode,
        "iperf3_rounds_gbps": [round(x, 3) for x in iperf],
        "iperf3_cpu_s_per_gb": round(statistics.median(iperf_cpu), 3),  # client and server
        "streams": args.streams,
        "bytes_per_round": nbytes,
        "rounds": args.rounds,
        "link": "veth between two network namespaces (same machine)",
        "verified": True,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for mode, r in per_mode.items():
            print(
                f"tcp_security={mode:8s} weightwire {r['weightwire_gbps']:.2f} Gbit/s vs iperf3 "
                f"{ip:.2f} Gbit/s: ratio {r['ratio']:.2f}; {r['cpu_s_per_gb']:.2f} CPU s/GB "
                f"(iperf3 {report['iperf3_cpu_s_per_gb']:.2f})"
            )
        print(
            f"({args.streams} streams over veth; medians of {args.rounds} rounds, each running "
            f"iperf3 and every setting in turn; {nbytes / 1e9:.2f} GB per weightwire round, "
            "bytes verified)"
        )
    return 0
