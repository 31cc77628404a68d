"""A one-rank trainer with a 48 MB tensor, for fault tests: publishes each version number
read from stdin; prints JSON events. Kill it mid-publish to test a dying trainer."""

from __future__ import annotations

import json
import sys
import time

import torch

from weightwire.client import Trainer

ROWS, COLS = 3 * 1024, 4096


def weights(version: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + version * 0.5


def main() -> None:
    sock, job = sys.argv[1], sys.argv[2]
    ring = int(sys.argv[3]) if len(sys.argv) > 3 else 4  # staging slots (0: the whole send)
    w = weights(0)
    with Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=ring) as tr:
        tr.register({"w": w})
        tr.prepare()
        print(json.dumps({"event": "ready", "t": time.time()}), flush=True)
        for line in sys.stdin:
            v = int(line)
            w.copy_(weights(v))
            print(json.dumps({"event": "start", "version": v, "t": time.time()}), flush=True)
            s = tr.publish(v)
            print(json.dumps({"event": "done", "version": v, "bytes": s.nbytes}), flush=True)


if __name__ == "__main__":
    main()
