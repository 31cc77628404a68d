"""Throughput of the verbs transport beside `ib_write_bw` on the same devices, in the same
VM run. Soft-RoCE under QEMU TCG: numbers for comparing the two, never for performance
claims about RDMA hardware.

    scripts/rdma-vm.sh -- python tests/rdma/throughput.py [--mib 64] [--rounds 5] [--json]

For each device pair (rxe1 -> rxe2 over the veth, rxe0 loopback): one 64 MiB region on
each side, writes of `--write-mib` (the plan's max_write_bytes, 32 MiB) with the default
knobs (8 MiB WRs, 4 per post, 1 QP), `--rounds` rounds alternating with ib_write_bw
(8 MiB messages), medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time

import structlog

from weightwire.memory.hostmem import create_shared
from weightwire.protocol.errors import PeerLostError
from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.verbs import VerbsTransport

MiB = 1 << 20
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def ib_write_bw(dev_a: str, dev_b: str, addr: str, size: int, iters: int) -> float:
    """perftest's ib_write_bw from dev_a to dev_b (server on dev_b): average MB/s."""
    cmd = ["ib_write_bw", "-x", "1", "-s", str(size), "-n", str(iters), "-F"]
    server = subprocess.Popen(
        [*cmd, "-d", dev_b], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [*cmd, "-d", dev_a, addr], capture_output=True, text=True, timeout=120
        ).stdout
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    # the result line: "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
    for line in out.splitlines():
        f = line.split()
        if len(f) == 5 and f[0] == str(size) and re.fullmatch(r"[\d.]+", f[3]):
            return float(f[3])
    raise RuntimeError(f"no result from ib_write_bw: {out}")


async def verbs_rounds(dev_a: str, dev_b: str, total: int, write: int, rounds: int) -> list[float]:
    nodes: dict[str, VerbsTransport] = {}

    def make(node: str, dev: str) -> VerbsTransport:
        t = VerbsTransport(node, devices=[dev])

        async def signal(peer: str, payload: bytes) -> bytes:
            if peer not in nodes:
                raise PeerLostError(peer)
            return await nodes[peer].on_signal(node, payload)

        t.set_signal(signal)
        nodes[node] = t
        return t

    a, b = make("a", dev_a), make("b", dev_b)
    imms: list[int] = []
    await a.start(lambda imm, src: None)
    await b.start(lambda imm, src: imms.append(imm))
    fa, fb = create_shared(total, purpose="bench"), create_shared(total, purpose="bench")
    fa.unlink()
    fb.unlink()
    src = LocalRegion(id=1, kind="cpu", length=total, view=fa.view, address=fa.address)
    dst = LocalRegion(id=2, kind="cpu", length=total, view=fb.view, address=fb.address)
    fa.view[:] = os.urandom(total)
    a.register(src)
    desc = RegionDescriptor(id=2, node="b", kind="cpu", length=total, keys=b.register(dst))
    await a.connect("b", b.endpoints())
    await a.write(WriteRequest(src, 0, desc, 0, MiB, 0))  # link up, descriptor checked: not timed
    out = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            parts = range(0, total, write)
            await asyncio.gather(
                *(a.write(WriteRequest(src, o, desc, o, min(write, total - o), o)) for o in parts)
            )
            out.append(total / (time.perf_counter() - t0) / 1e6)
        assert bytes(fb.view) == bytes(fa.view), "bytes differ"
    finally:
        await a.close()
        await b.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--write-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    pairs = []
    pair = os.environ.get("WEIGHTWIRE_RDMA_PAIR", "").split()
    if len(pair) == 2:
        pairs.append(("veth", pair[0], pair[1], "10.233.0.2"))
    pairs.append(("loopback", "rxe0", "rxe0", "127.0.0.1"))
    results = {}
    for label, da, db, addr in pairs:
        verbs, ib = [], []
        for _ in range(a.rounds):  # alternate, one round each
            verbs += asyncio.run(verbs_rounds(da, db, a.mib * MiB, a.write_mib * MiB, 1))
            ib.append(ib_write_bw(da, db, addr, 8 * MiB, max(5, a.mib // 8)))
        results[label] = {
            "devices": f"{da} -> {db}",
            "weightwire_MBps": round(statistics.median(verbs), 1),
            "ib_write_bw_MBps": round(statistics.median(ib), 1),
            "ratio": round(statistics.median(verbs) / statistics.median(ib), 2),
            "rounds": a.rounds,
            "bytes_per_round": a.mib * MiB,
        }
    if a.json:
        print(json.dumps(results))
    else:
        for label, r in results.items():
            print(
                f"{label:9} {r['devices']}: weightwire {r['weightwire_MBps']} MB/s, "
                f"ib_write_bw {r['ib_write_bw_MBps']} MB/s, ratio {r['ratio']} "
                f"(median of {r['rounds']}, {a.mib} MiB per round)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
