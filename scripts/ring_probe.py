"""CPU latency probe of the staging ring's slot round trip (no GPU needed): a real daemon,
one host, CPU staging, 64 buckets of 1 MiB through a ring of N slots, every byte checked.
Prints, from the publish's BucketTimes, the medians of packed -> posted (the daemon
learning of a bucket), posted -> landed, and landed(k) -> packing of k+N started (the
trainer's wake-up for a free slot).

    .venv/bin/python scripts/ring_probe.py [slots=2] [versions=10]
"""

from __future__ import annotations

import statistics
import sys

import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster

BUCKET = 1 << 20


def main() -> None:
    slots = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    versions = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    extra = {"bucket-bytes": str(BUCKET), "max-write-bytes": str(BUCKET)}
    c = LocalCluster(hosts=1, extra=extra)
    c.start()
    c.wait_joined()
    try:
        dst = torch.zeros(64, BUCKET // 4)
        w = torch.randn(64, BUCKET // 4)
        sock = c.daemons[0].socket
        with (
            Engine(0, 1, socket=sock, job="probe", timeout_s=60) as eng,
            Trainer(0, 1, socket=sock, job="probe", timeout_s=60, staging_buckets=slots) as tr,
        ):
            eng.register({"w": dst})
            tr.register({"w": w})
            tr.prepare()
            post: list[float] = []
            land: list[float] = []
            wake: list[float] = []
            total: list[float] = []
            for v in range(versions + 1):
                w.add_(1)
                s = tr.publish(v)
                eng.wait(v)
                assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8)), v
                if v == 0:  # warm-up
                    continue
                b = s.buckets
                total.append(s.total_seconds)
                post += [x.posted - x.prepared for x in b]
                land += [x.landed - x.posted for x in b]
                wake += [b[k + slots].prepare_start - b[k].landed for k in range(len(b) - slots)]
        ms = statistics.median
        print(
            f"ring {slots}: publish {ms(total) * 1e3:.2f} ms; per bucket: packed->posted "
            f"{ms(post) * 1e3:.3f} ms, posted->landed {ms(land) * 1e3:.3f} ms, "
            f"landed->next pack {ms(wake) * 1e3:.3f} ms (medians of {versions} versions)"
        )
    finally:
        c.stop()


if __name__ == "__main__":
    main()
