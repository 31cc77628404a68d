"""A bench trainer rank: weights of each version, a weightwire publish, the baseline's
gather and broadcast."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from weightwire.client import Full, Shard, Trainer

from . import model as M
from .rank_base import Rank


class TrainerRank(Rank):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self._profiles: list[cProfile.Profile] = []
        self.full = args.trainer_layout == "full"
        self.rows = {
            t.name: (0, t.shape[0]) if self.full else M.shard_rows(t.shape[0], self.index, self.T)
            for t in self.hf
        }
        specs = [
            (t.name, t.dtype, (hi - lo, *t.shape[1:]))
            for t in self.hf
            for lo, hi in [self.rows[t.name]]
        ]
        self.buf, self.views = M.flat_views(specs, self.device)
        self.gen(0)
        self.tr = Trainer(
            self.index,
            self.T,
            socket=args.socket,
            job=args.job,
            timeout_s=args.timeout,
            staging=args.staging,
            staging_buckets=args.staging_buckets,
            direct=args.direct,
            slot_events=args.slot_wait != "landing",
            slot_counters=args.slot_wait in ("counters", "packed"),
            gate_copies=args.slot_wait == "counters",
        )
        layout = Full() if self.full else Shard(0, self.index, self.T)
        self.tr.register(
            self.views,
            layout=layout,
            global_shapes={t.name: t.shape for t in self.hf},
            zero_copy=args.zero_copy and self.device.type == "cuda",
        )
        t0 = time.perf_counter()
        plan = self.tr.prepare(args.timeout)
        by_engine: dict[int, int] = defaultdict(int)
        for b in plan.buckets:
            for w in b.writes:
                by_engine[w.dst_rank] += w.nbytes
        self.summary = {
            "plan_s": time.perf_counter() - t0,
            "staging_bytes": self.tr.staging_bytes,  # held: the ring, or the whole send
            "send_staging_bytes": plan.staging_bytes,  # the whole send's
            "staging_buckets": self.tr.ring(plan).slots,
            "buckets": len(plan.buckets),
            "packs": sum(len(b.packs) for b in plan.buckets),
            "writes": plan.write_count,
            "bytes": plan.write_bytes,
            "by_engine": {str(k): v for k, v in sorted(by_engine.items())},
            "shard_bytes": self.buf.numel(),
            "staging": args.staging if args.staging != "auto" else ("gpu" if self.cuda else "cpu"),
        }
        if args.baseline:
            self._baseline_buffers()

    def gen(self, version: int) -> float:
        t0 = time.perf_counter()
        for t in self.hf:
            view = self.views[t.name]
            if view.numel() == 0:
                continue
            lo, hi = self.rows[t.name]
            if view.dtype == torch.bfloat16:
                self.content.fill(view, t.name, version, lo * M.numel(t.shape[1:]))
            else:
                view.copy_(self.content.rows(t, lo, hi, version))
        self.clock.sync()
        return time.perf_counter() - t0

    def ww(self, version: int) -> dict[str, Any]:
        t0 = self.barrier()
        # WEIGHTWIRE_BENCH_PROFILE=PREFIX: the publishes from version 2 on under cProfile,
        # the totals rewritten to PREFIX-rank<N>.txt after each (where the host time goes)
        prefix = os.environ.get("WEIGHTWIRE_BENCH_PROFILE")
        prof = cProfile.Profile() if prefix and version >= 2 else None
        if prof is not None:
            prof.enable()
        s = self.tr.publish(version)
        end = time.time()
        if prof is not None:
            prof.disable()
            self._profiles.append(prof)
            with open(f"{prefix}-rank{self.index}.txt", "w") as f:
                st = pstats.Stats(*self._profiles, stream=f)
                st.sort_stats("tottime").print_stats(40)
                st.sort_stats("cumulative").print_stats(40)
        return {
            "t0": t0,
            "end": end,
            "nbytes": s.nbytes,
            "writes": s.writes,
            "seconds": s.seconds,
            "pack_seconds": s.pack_seconds,
            "transfer_seconds": s.transfer_seconds,
            "total_seconds": s.total_seconds,
            "slot_events": s.slot_events,  # ring slots freed by the daemon's IPC events
            "slot_landings": s.slot_landings,  # ring slots freed by landings
            "slot_counters": s.slot_counters,  # ring slots waited for on GPU counters
            "begin_seconds": s.begin_seconds,  # publish call -> version accepted
            "begin_request_seconds": s.begin_request_seconds,  # of it, BeginVersion's trip
            "timeline": s.timeline,  # the daemon's first events, s after it accepted
            "gated": s.gated,  # posted before packed: the copies waited for the pack counter
            "buckets": [
                [b.index, b.nbytes, b.prepare_start, b.prepared, b.posted, b.landed]
                for b in s.buckets
            ],
        }

    # --- the broadcast baseline ------------------------------------------------
    def _baseline_buffers(self) -> None:
        """Per bucket: this rank's padded chunk of every tensor (all_gather input), the
        gathered chunks, and on rank 0 the full tensors in one flat broadcast buffer."""
        self.segs: list[tuple[list[int], int]] = []  # per bucket: chunk offsets, chunk bytes
        seg_max = 0
        for b in self.buckets:
            offs, off = [], 0
            for t in b.tensors:
                row = M.nbytes(t) // max(t.shape[0], 1)
                off = -(-off // M.ALIGN) * M.ALIGN
                offs.append(off)
                off += -(-t.shape[0] // self.T) * row
            self.segs.append((offs, off))
            seg_max = max(seg_max, off)
        gather = self.T > 1 and not self.full
        self.send = torch.empty(seg_max if gather else 0, dtype=torch.uint8, device=self.device)
        self.recv = torch.empty(
            self.T * seg_max if gather else 0, dtype=torch.uint8, device=self.device
        )
        biggest = max(b.nbytes for b in self.buckets)
        self.bcast = torch.empty(
            biggest if self.index == 0 else 0, dtype=torch.uint8, device=self.device
        )

    def base(self, version: int) -> dict[str, Any]:
        gather = self.T > 1 and not self.full
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        t0 = self.barrier()
        marks = []
        for b, (offs, seg) in zip(self.buckets, self.segs, strict=True):
            m0 = self.clock.mark()
            if gather:
                for t, off in zip(b.tensors, offs, strict=True):
                    local = M.as_bytes(self.views[t.name])
                    self.send[off : off + local.numel()].copy_(local)
                ag(self.recv[: self.T * seg], self.send[:seg], group=self.tgroup)
                if self.index == 0:
                    for t, off, full_off in zip(b.tensors, offs, b.offsets, strict=True):
                        row = M.nbytes(t) // max(t.shape[0], 1)
                        for q in range(self.T):
                            lo, hi = M.shard_rows(t.shape[0], q, self.T)
                            n = (hi - lo) * row
                            src = self.recv[q * seg + off : q * seg + off + n]
                            dst0 = full_off + lo * row
                            self.bcast[dst0 : dst0 + n].copy_(src)
            elif self.index == 0:
                for t, full_off in zip(b.tensors, b.offsets, strict=True):
                    local = M.as_bytes(self.views[t.name])
                    self.bcast[full_off : full_off + local.numel()].copy_(local)
            m1 = self.clock.mark()
            if self.index == 0:
                dist.broadcast(self.bcast[: b.nbytes], src=0, group=self.bgroup)
            m2 = self.clock.mark()
            marks.append((m0, m1, m2))
        spans, end = self.spans(marks)
        return {
            "t0": t0,
            "end": end,
            "gather_s": sum(s[1] - s[0] for s in spans),
            "broadcast_s": sum(s[2] - s[1] for s in spans) if self.index == 0 else 0.0,
            "spans": spans,
        }

    def close(self) -> None:
        self.tr.close()
        super().close()
