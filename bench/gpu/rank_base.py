"""What both roles of a bench rank share: events to the launcher, the clock, the
torch.distributed groups."""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightwire.client.pack import Packer
from weightwire.plan.rules import hf_tensors

from . import model as M


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


class Clock:
    """Stage marks: CUDA events on the current stream (no synchronization in the timed
    loop), or wall-clock times on CPU; `resolve` gives wall-clock seconds."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t0 = 0.0
        self._e0: Any = None

    def start(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record()
        self.t0 = time.time()
        return self.t0

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.time()

    def resolve(self, m: Any) -> float:
        if self.cuda:
            return self.t0 + float(self._e0.elapsed_time(m)) / 1000.0
        return float(m)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(args.gpu)
            self.device = torch.device("cuda", args.gpu)
        else:
            torch.set_num_threads(1)  # several rank processes share few cores
            self.device = torch.device("cpu")
        self.T, self.E = args.trainers, args.engines
        self.trainer = args.role == "trainer"
        self.index = args.rank
        self.global_rank = self.index if self.trainer else self.T + self.index
        self.cfg = M.load_config(args.config)
        self.hf = hf_tensors(self.cfg)
        self.hf_by_name = {t.name: t for t in self.hf}
        self.content = M.Content(self.device, max(M.numel(t.shape) for t in self.hf))
        self.clock = Clock(self.cuda)
        self.buckets = M.baseline_buckets(self.hf, args.bucket_mb << 20)
        self.packer = Packer()
        self._init_dist()

    # --- torch.distributed -----------------------------------------------------
    def _init_dist(self) -> None:
        a = self.args
        backend = "nccl" if a.nccl else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = self.device
        dist.init_process_group(
            backend,
            init_method=Path(a.dist_store).resolve().as_uri(),  # no port to race others for
            rank=self.global_rank,
            world_size=self.T + self.E,
            timeout=timedelta(seconds=a.timeout),
            **kwargs,
        )
        # the same groups, created in the same order, on every rank
        self.ctrl = dist.new_group(backend="gloo") if backend == "nccl" else None
        self.tgroup = dist.new_group(list(range(self.T))) if a.baseline and self.T > 1 else None
        self.bgroup = dist.new_group([0, *range(self.T, self.T + self.E)]) if a.baseline else None

    def barrier(self) -> float:
        self.clock.sync()
        dist.barrier(group=self.ctrl)
        return self.clock.start()

    def spans(self, marks: list[tuple[Any, ...]]) -> tuple[list[list[float]], float]:
        """Each bucket's marks as seconds, once the GPU is done; and the end time."""
        self.clock.sync()
        end = time.time()
        return [[self.clock.resolve(m) for m in ms] for ms in marks], end

    def close(self) -> None:
        dist.destroy_process_group()
