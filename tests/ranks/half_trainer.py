"""A trainer rank that dies mid-publish: it posts bucket 0 of version 1, then SIGKILLs itself
before packing the rest. Used to prove a partial version never completes anywhere."""

from __future__ import annotations

import os
import signal
import sys
import time

from weightwire.client import Trainer
from weightwire.client.pack import pack
from weightwire.protocol.local import BeginVersion, BucketReady

from .big_trainer import weights


def main() -> None:
    sock, job = sys.argv[1], sys.argv[2]
    w = weights(1)
    tr = Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=0)  # whole send
    tr.register({"w": w})
    plan = tr.prepare()
    assert len(plan.buckets) > 1, "the test needs a plan of several buckets"
    staging = tr._ensure_staging(plan)
    tr._conn.request(BeginVersion(version=1, plan_hash=plan.plan_hash))
    for op in plan.buckets[0].packs:
        pack(op, w, staging)
    tr._conn.send(BucketReady(version=1, bucket=0))
    print(f"posted 1 of {len(plan.buckets)} buckets", flush=True)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
