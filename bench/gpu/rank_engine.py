"""A bench engine rank: its weights as destinations, a weightwire wait, the baseline's
receive and copy-in, and the bitwise check."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from weightwire.client import Engine
from weightwire.client.dtypes import TORCH
from weightwire.plan.rules import engine_tensors
from weightwire.protocol.local import EngineLayout

from . import model as M
from .rank_base import Rank


class EngineRank(Rank):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.layout = EngineLayout(
            tp_size=self.E,
            tp_rank=self.index,
            model=self.cfg,
            dest_dtype=M.dest_dtype(args.dest),
        )
        self.ets = engine_tensors(self.cfg, self.layout)
        self.buf, self.views = M.flat_views(
            [(t.name, t.dtype, t.shape) for t in self.ets], self.device
        )
        self.arrived: dict[int, float] = {}
        self.eng = Engine(
            self.index, self.E, socket=args.socket, job=args.job, timeout_s=args.timeout
        )
        self.eng.on_version(self._landed)
        self.eng.register(self.views, layout=self.layout)
        # bytes views after registering: host tensors were moved into the shared region
        self.bytes = {name: M.as_bytes(v) for name, v in self.views.items()}
        self.uses: dict[str, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        for t in self.ets:
            for piece in t.pieces:
                if piece.sent:
                    self.uses[piece.source].append((self.bytes[t.name], piece))
        scales = [M.nbytes(t) for t in self.ets if t.name.endswith("_scale_inv")]
        self.scratch = [
            torch.empty(max(M.nbytes(t) for t in self.ets), dtype=torch.uint8, device=self.device),
            torch.empty(max(scales, default=1), dtype=torch.uint8, device=self.device),
        ]
        self.summary = {
            "bytes": sum(M.nbytes(t) for t in self.ets),
            "tensors": len(self.ets),
            "pieces": sum(len(v) for v in self.uses.values()),
        }
        if args.baseline:
            self.bcast = torch.empty(
                max(b.nbytes for b in self.buckets), dtype=torch.uint8, device=self.device
            )

    def _landed(self, info: Any) -> None:
        if not isinstance(info, Exception):
            self.arrived.setdefault(info.version, time.time())

    def zero(self) -> None:
        for v in self.views.values():
            v.zero_()
        self.clock.sync()

    def ww(self, version: int) -> dict[str, Any]:
        self.zero()
        t0 = self.barrier()
        info = self.eng.wait(version, self.args.timeout)
        end = time.time()
        return {
            "t0": t0,
            "end": min(end, self.arrived.get(version, end)),
            "nbytes": info.nbytes,
            "daemon_seconds": info.seconds,
        }

    def base(self, version: int) -> dict[str, Any]:
        self.zero()
        t0 = self.barrier()
        marks = []
        for b in self.buckets:
            m0 = self.clock.mark()
            dist.broadcast(self.bcast[: b.nbytes], src=0, group=self.bgroup)
            m1 = self.clock.mark()
            for t, off in zip(b.tensors, b.offsets, strict=True):
                uses = self.uses.get(t.name)
                if not uses:
                    continue
                n = M.nbytes(t)
                full = self.bcast[off : off + n].view(TORCH[t.dtype]).view(t.shape)
                for out, piece in uses:
                    M.pack_piece(self.packer, piece, full, t.dtype, out)
            self.packer.clear()
            m2 = self.clock.mark()
            marks.append((m0, m1, m2))
        spans, end = self.spans(marks)
        return {
            "t0": t0,
            "end": end,
            "receive_s": sum(s[1] - s[0] for s in spans),
            "copy_in_s": sum(s[2] - s[1] for s in spans),
            "spans": spans,
        }

    def verify(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        bad = []
        checked = 0
        by_name = {t.name: t for t in self.ets}
        done: set[str] = set()
        for t in self.ets:
            if t.name in done:
                continue
            group = [t]
            partner = by_name.get(t.name + "_scale_inv")
            if partner is not None and M.lockstep(t, partner):
                group.append(partner)
            wants = M.expected(
                group,
                self.hf_by_name,
                self.content,
                version,
                self.packer,
                self.scratch[: len(group)],
            )
            for u, want in zip(group, wants, strict=True):
                done.add(u.name)
                if not torch.equal(self.bytes[u.name], want):
                    bad.append(u.name)
                checked += want.numel()
        return {
            "ok": not bad and len(done) == len(self.ets),
            "mismatched": bad[:8],
            "mismatched_count": len(bad),
            "bytes": checked,
            "seconds": time.perf_counter() - t0,
        }

    def close(self) -> None:
        self.eng.close()
        super().close()
