"""Packing kernels against the same-GPU copy rate, one bucket at a time (GPU only).

    python -m weightwire.bench.packrate [--bucket-mb 256] [--reps 20] [--json]

A bucket like the colocated bench's: expert tensors of (768, 2048) bf16 (3 MiB each, one
allocation each) whose bytes go to one destination (an engine's memory when packing in
place). Every variant is captured once as a CUDA graph and replayed `reps` times between
CUDA events; the median replay is its time. The baseline, in the same process: one copy
of the bucket's bytes from one contiguous buffer (torch copy_), as `weightwire bench gpu`
measures the link rate. Reported per variant: ms per bucket, GB/s of destination bytes,
that over the baseline's rate (the bench's "of the rate" for a bucket alone, no daemon),
and, for launches, the host time of a replay and the GPU time of an empty-ish launch
(one 16-byte copy): the per-bucket and per-launch costs; and the host microseconds of a
whole `Packer.pack_bucket` per bucket (bf16 and FP8).

bf16 (the pack is a copy): torch's multi-tensor copy (before), one copy_ per tensor, the
Triton copy kernel (`client/copy_kernel.py`). FP8 (codes + scales in destination layout,
every variant checked bitwise against `quantize_blocks`): the Triton kernel's generic
launch with the integer rounding (before), the aligned launch with the integer rounding,
and with the hardware rounding each launch variant of `fp8_kernel.VARIANTS` (`--variants`:
rows of a tile at a time, warps, reciprocal division), then what `fp8_kernel.tune` (the
trainer's pick, once per process) measures and picks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROWS, COLS = 768, 2048
DEVICE = "cuda"  # the CPU self-test (tests/test_packrate.py) runs it through the interpreter


def _timed(fn: Callable[[], None], reps: int) -> dict[str, float]:
    """fn captured as a CUDA graph: median GPU ms of a replay, mean host us per replay."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles Triton kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        h = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - h)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"ms": statistics.median(times), "host_us": 1e6 * statistics.mean(host)}


def _host_costs(experts: list[torch.Tensor], dst: torch.Tensor, reps: int) -> dict[str, float]:
    """Host microseconds per bucket of what the trainer does around the GPU work: a whole
    `Packer.pack_bucket` of the bf16 and of the FP8 bucket (the batch's identity check and
    its graph replay), and a CUDA event made and recorded (the Poster's, per bucket)."""
    from weightwire.client.pack import Packer
    from weightwire.protocol.plan import PackOp
    from weightwire.protocol.tensors import Box, Copy, Fp8BlockQuant, Fp8BlockScale

    tensors = {f"e{i}": e for i, e in enumerate(experts)}
    box = Box.full((ROWS, COLS))
    copies, fp8, at = [], [], 0
    tiles = -(-ROWS // 128) * -(-COLS // 128)
    for name, e in tensors.items():
        copies.append(PackOp(source=name, box=box, transform=Copy(), staging_offset=at,
                             nbytes=e.nbytes))  # fmt: skip
        fp8.append(PackOp(source=name, box=box, transform=Fp8BlockQuant(block=128),
                          staging_offset=at // 2, nbytes=e.numel()))  # fmt: skip
        fp8.append(PackOp(source=name, box=box, transform=Fp8BlockScale(block=128),
                          staging_offset=dst.numel() - (len(fp8) // 2 + 1) * tiles * 4,
                          nbytes=tiles * 4))  # fmt: skip
        at += e.nbytes
    got: dict[str, float] = {}
    for label, ops in (("pack_bucket bf16", tuple(copies)), ("pack_bucket fp8", tuple(fp8))):
        p = Packer()
        p.pack_bucket(ops, tensors, dst)  # made, run eagerly, captured
        p.pack_bucket(ops, tensors, dst)
        if dst.is_cuda:
            torch.cuda.synchronize()
        host = []
        for _ in range(reps):
            h = time.perf_counter()
            p.pack_bucket(ops, tensors, dst)
            host.append(time.perf_counter() - h)
            if dst.is_cuda:
                torch.cuda.synchronize()
        got[f"{label} us"] = 1e6 * statistics.median(host)
    if dst.is_cuda:
        h = time.perf_counter()
        for _ in range(reps):
            torch.cuda.Event().record()  # type: ignore[no-untyped-call]
        got["event made and recorded us"] = 1e6 * (time.perf_counter() - h) / reps
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=int, default=256, help="source MiB per bucket")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    ap.add_argument("--variants", default="all",
                    help="FP8 launch variants (fp8_kernel.VARIANTS), comma-separated")  # fmt: skip
    args = ap.parse_args(argv)
    from weightwire.client import fp8_kernel as fk

    names = list(fk.VARIANTS) if args.variants == "all" else args.variants.split(",")
    if fk.INTERPRETED:  # the reciprocal division needs a fused multiply-add (GPU only)
        names = [n for n in names if n in fk.VARIANTS and not fk.VARIANTS[n].fast_div]
    args.variants = names
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("packrate: needs a CUDA GPU", file=sys.stderr)
        return 2
    from weightwire.client import copy_kernel, fp8_kernel
    from weightwire.client.copy_kernel import CopyBatch
    from weightwire.client.fp8 import quantize_blocks
    from weightwire.client.fp8_kernel import Fp8Batch, Fp8Box

    dev = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device(DEVICE)
    n = max(1, (args.bucket_mb << 20) // (ROWS * COLS * 2))
    g = torch.Generator(device=dev).manual_seed(0)
    experts = [
        torch.randn((ROWS, COLS), generator=g, device=dev).to(torch.bfloat16) for _ in range(n)
    ]
    nbytes = sum(e.nbytes for e in experts)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=dev)
    rows: list[dict[str, Any]] = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    out: dict[str, Any] = {"device": name, "torch": torch.__version__, "tensors": n,
                           "bucket_bytes": nbytes, "rows": rows}  # fmt: skip

    def add(what: str, fn: Callable[[], None], dst_bytes: int, **extra: Any) -> None:
        t = _timed(fn, args.reps)
        gbps = dst_bytes / t["ms"] / 1e6
        rows.append({"what": what, **t, "dst_bytes": dst_bytes, "gbps": gbps, **extra})

    add("baseline: one copy_ of the bucket's bytes", lambda: dst[:nbytes].copy_(flat), nbytes)
    rate = rows[0]["gbps"]
    pairs = []
    at = 0
    for e in experts:
        pairs.append((e, dst[at : at + e.nbytes]))
        at += e.nbytes
    outs = [d.view(torch.bfloat16).view(ROWS, COLS) for _, d in pairs]
    add("bf16: torch._foreach_copy_ (before)", lambda: torch._foreach_copy_(outs, experts), nbytes)

    def per_pair() -> None:
        for o, e in zip(outs, experts, strict=True):
            o.copy_(e)

    add("bf16: one copy_ per tensor", per_pair, nbytes)
    if copy_kernel.available([dst, *experts]):
        batch = CopyBatch(pairs)
        add("bf16: copy kernel, one launch", batch.run, nbytes, launches=len(batch.launches))
        assert all(torch.equal(o, e) for o, e in zip(outs, experts, strict=True))
        tiny = CopyBatch([(flat[:16], dst[:16])])
        add("launch: copy kernel, 16 bytes", tiny.run, 16)
    # FP8: codes then scales of each expert, 16-byte aligned, as the planner lays them out
    block = 128
    tiles = -(-ROWS // block) * -(-COLS // block)
    boxes, at = [], 0
    for e in experts:
        boxes.append(Fp8Box(e, at, at + e.numel()))
        at = -(-(at + e.numel() + tiles * 4) // 16) * 16
    fp8_bytes = n * (ROWS * COLS + tiles * 4)
    want = [quantize_blocks(e, block) for e in experts]

    def check(label: str) -> bool:
        got = dst.cpu()
        for b, (codes, scales) in zip(boxes, want, strict=True):
            c = got[b.codes_offset : b.codes_offset + codes.numel()]
            s = got[b.scales_offset : b.scales_offset + scales.numel() * 4]
            if not torch.equal(c, codes.cpu().view(torch.uint8).flatten()):
                print(f"packrate: {label}: codes differ from quantize_blocks", file=sys.stderr)
                return False
            if not torch.equal(s, scales.cpu().view(torch.uint8).flatten()):
                print(f"packrate: {label}: scales differ from quantize_blocks", file=sys.stderr)
                return False
        return True

    if fp8_kernel.available([dst, *experts], block):
        runs = [
            ("fp8: generic launch, integer rounding (before)", False, False, "whole-w8"),
            ("fp8: aligned launch, integer rounding", True, False, "whole-w8"),
        ]
        runs += [(f"fp8: aligned, hardware rounding, {v}", True, True, v) for v in args.variants]
        for label, vectors, hw, variant in runs:
            fp8_kernel.HW_CVT = hw
            fb = Fp8Batch(boxes, dst, block, vectors=vectors, variant=variant)
            dst.zero_()
            add(label, fb.run, fp8_bytes, hw_cvt=fb.hw_cvt, launches=len(fb.launches),
                variant=fb.variant.name)  # fmt: skip
            rows[-1]["bitwise"] = check(label)
        if dev.type == "cuda":  # what a trainer's first FP8 bucket picks (fp8_kernel.tune)
            h = time.perf_counter()
            out["tuned"] = fp8_kernel.tune(torch.bfloat16, dev, block)
            out["tune_seconds"] = time.perf_counter() - h  # compiled already: timing only
            out["tune_ms"] = next(iter(fp8_kernel.TUNE_LOG.values()))
        stacked = torch.stack(experts)
        add("fp8: torch quantize_blocks of the stack (no copy out)",
            lambda: quantize_blocks(stacked, block) and None, fp8_bytes)  # fmt: skip
    out["host"] = _host_costs(experts, dst, args.reps)
    for r in rows:
        r["of_rate"] = r["gbps"] / rate
    if args.json:
        print(json.dumps(out, indent=1))
    w = max(len(r["what"]) for r in rows)
    print(f"packrate on {name}: {n} tensors of {ROWS}x{COLS} bf16, {nbytes / 1e6:.0f} MB per "
          f"bucket; GB/s of destination bytes, median of {args.reps} graph replays",
          file=sys.stderr)  # fmt: skip
    print(f"  {'variant':<{w}}  {'ms':>7}  {'GB/s':>7}  {'of rate':>7}  {'host us':>7}  bitwise",
          file=sys.stderr)  # fmt: skip
    for r in rows:
        bit = {True: "ok", False: "DIFFERS"}.get(r.get("bitwise"), "")  # type: ignore[call-overload]
        print(f"  {r['what']:<{w}}  {r['ms']:7.3f}  {r['gbps']:7.1f}  {r['of_rate']:7.2f}  "
              f"{r['host_us']:7.1f}  {bit}", file=sys.stderr)  # fmt: skip
    if "tuned" in out:
        print(f"  tune (fp8_kernel.tune, 48 MiB scratch): picked {out['tuned']} in "
              f"{out['tune_seconds']:.2f} s; ms " + ", ".join(
                  f"{k} {v:.3f}" for k, v in out["tune_ms"].items()), file=sys.stderr)  # fmt: skip
    print("  host per bucket: " + ", ".join(f"{k} {v:.1f}" for k, v in out["host"].items()),
          file=sys.stderr)  # fmt: skip
    return 0 if all(r.get("bitwise", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
