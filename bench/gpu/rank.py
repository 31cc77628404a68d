"""One rank of `weightwire bench gpu`, as its own process:
`python -m weightwire.bench.gpu.rank trainer|engine ...`.

It talks to the launcher with JSON lines (commands on stdin, events on stdout), like the
demo's ranks. Every rank also joins one torch.distributed group (NCCL on GPUs, gloo on
CPU) for the baseline and a gloo group for the barriers that start each timed sync.

Commands: `gen` (trainers: new weights of a version, untimed), `ww` (a weightwire sync:
barrier, trainers publish, engines wait), `base` (the broadcast baseline: barrier, per
bucket all_gather on the trainers, broadcast from trainer 0, copy-in on the engines),
`verify` (engines: every tensor bitwise against the expected bytes), `quit`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightwire.client import Engine, Full, Shard, Trainer
from weightwire.client.dtypes import TORCH
from weightwire.client.pack import Packer
from weightwire.plan.rules import engine_tensors, hf_tensors
from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.local import EngineLayout

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
            init_method=f"tcp://127.0.0.1:{a.dist_port}",
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

    def close(self) -> None:
        dist.destroy_process_group()


class TrainerRank(Rank):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
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
            "staging_bytes": plan.staging_bytes,
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
        s = self.tr.publish(version)
        return {
            "t0": t0,
            "end": time.time(),
            "nbytes": s.nbytes,
            "writes": s.writes,
            "seconds": s.seconds,
            "pack_seconds": s.pack_seconds,
            "transfer_seconds": s.transfer_seconds,
            "total_seconds": s.total_seconds,
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
        self.clock.sync()
        end = time.time()
        spans = [[self.clock.resolve(m) for m in ms] for ms in marks]
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
        self.clock.sync()
        end = time.time()
        spans = [[self.clock.resolve(m) for m in ms] for ms in marks]
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


def serve(rank: TrainerRank | EngineRank) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "quit":
            break
        v = int(cmd.get("version", 0))
        try:
            if what == "gen":
                out = {"seconds": rank.gen(v) if isinstance(rank, TrainerRank) else 0.0}
            elif what == "ww":
                out = rank.ww(v)
            elif what == "base":
                out = rank.base(v)
            elif what == "verify" and isinstance(rank, EngineRank):
                out = rank.verify(v)
            else:
                raise ValueError(f"unknown command {what!r} for a {rank.args.role}")
        except WeightwireError as exc:
            say(event="error", cmd=what, version=v, code=exc.code.value, message=exc.message)
            continue
        say(event="done", cmd=what, version=v, **out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "engine"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--config", required=True, help="the (possibly shrunk) HF config, JSON")
    p.add_argument("--dest", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="bench-gpu")
    p.add_argument("--staging", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--zero-copy", action="store_true")
    p.add_argument("--trainer-layout", choices=["fsdp", "full"], default="fsdp")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--dist-port", type=int, required=True)
    p.add_argument("--nccl", action="store_true")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    rank: TrainerRank | EngineRank | None = None
    try:
        t0 = time.perf_counter()
        rank = TrainerRank(args) if args.role == "trainer" else EngineRank(args)
        say(
            event="ready",
            role=args.role,
            rank=args.rank,
            gpu=args.gpu if args.device == "cuda" else None,
            setup_s=time.perf_counter() - t0,
            **rank.summary,
        )
        serve(rank)
    except WeightwireError as exc:
        say(event="fatal", code=exc.code.value, message=exc.message)
        sys.exit(1)
    except Exception as exc:
        say(event="fatal", code="exception", message=f"{exc!r}\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        if rank is not None:
            with contextlib.suppress(Exception):
                rank.close()


if __name__ == "__main__":
    main()
