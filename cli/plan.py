"""`weightwire plan`: what a weight sync of a model costs on a cluster, before running one.

Reads a Hugging Face config.json, lays out the engine ranks the way SGLang holds the
model (`plan.rules`), declares N trainer GPUs that each gather full tensors before
sending (as Perplexity does: an FSDP dim-0 shard of a Kimi-K2 expert over 256 ranks is 8
rows, too few for 128x128 FP8 blocks), plans the job with the real planner, and prints:

- bytes per NIC (trainers and engine GPUs: summary and the busiest),
- the busiest-NIC lower bound (`plan.bound`, from the model and topology alone),
- the simulated transfer time of the plan (`plan.simulate`, flow level) and its
  efficiency, bound / simulated.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weightwire.protocol.errors import PlanError

from .flags import Deprecated
from .plan_plot import plot
from .plan_ranks import Topology
from .plan_report import Progress, run_plan
from .plan_text import render


def parse_engines(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"--engines wants RxT (replicas x GPUs), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def is_moe(config: Mapping[str, Any]) -> bool:
    return bool(config.get("num_experts") or config.get("n_routed_experts"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face config.json")
    p.add_argument("--trainers", type=int, required=True, help="trainer GPUs (one NIC each)")
    p.add_argument(
        "--engines", type=parse_engines, required=True, help="RxT: R engine replicas of T GPUs"
    )
    nic = p.add_mutually_exclusive_group(required=True)
    nic.add_argument("--nic-gbit", dest="nic_gbps", type=float, help="NIC rate per GPU, Gbit/s")
    nic.add_argument("--nic-gbps", dest="nic_gbps", type=float, action=Deprecated, use="--nic-gbit")
    p.add_argument("--dtype", choices=["fp8", "bf16"], required=True, help="engine weights")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: T for MoE)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="plan bucket size (MiB)")
    p.add_argument(
        "--tail-mb",
        type=float,
        default=64.0,
        help="the last bucket-mb of each trainer's send in buckets of at most this (MiB; 0: off)",
    )
    p.add_argument("--max-write-mb", type=float, default=32.0, help="largest write (MiB)")
    p.add_argument("--bucket-overhead-us", type=float, default=100.0, help="fixed cost per bucket")
    p.add_argument("--write-overhead-us", type=float, default=0.0, help="fixed cost per write")
    p.add_argument(
        "--pack-gbyte-s",
        dest="pack_gbps",
        type=float,
        default=0.0,
        help="packing rate, GB/s (0: instantaneous)",
    )
    p.add_argument(
        "--pack-gbps", dest="pack_gbps", type=float, action=Deprecated, use="--pack-gbyte-s"
    )
    p.add_argument("--sim-tol", type=float, default=1e-4, help="simulator event window")
    p.add_argument("--top", type=int, default=5, help="busiest NICs listed")
    p.add_argument("--plot", metavar="FILE.png", help="per-NIC bytes and finish times")
    p.add_argument(
        "--progress-after",
        type=float,
        default=2.0,
        metavar="S",
        help="phase lines on stderr once planning has taken S seconds",
    )
    p.add_argument(
        "--staging-buckets",
        type=int,
        default=4,
        help="trainer staging ring slots, as Trainer(staging_buckets=N); 0: the whole send",
    )
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.add_argument(
        "--delta-density",
        type=float,
        help="also simulate a sparse delta version with this fraction of elements changed",
    )
    p.add_argument(
        "--delta-encode-gbyte-s",
        dest="delta_encode_gbps",
        type=float,
        default=400.0,
        help="senders' compare+encode rate, GB/s of dense input (H100, torch: 388-466)",
    )
    p.add_argument(
        "--delta-verify-gbyte-s",
        dest="delta_verify_gbps",
        type=float,
        default=1000.0,
        help="engines' checksum rate over the bytes they receive, GB/s (assumed; measure it "
        "with tests/test_delta_gpu.py)",
    )
    p.add_argument(
        "--delta-apply-gbyte-s",
        dest="delta_apply_gbps",
        type=float,
        default=0.0,
        help="engines' payload decode+scatter rate, GB/s of dense input, in the same queue as "
        "their checksum (H100, 3 %%: 617; tests/test_delta_gpu.py); 0: not modelled",
    )
    for old, new in (("encode", "--delta-encode-gbyte-s"), ("verify", "--delta-verify-gbyte-s")):
        p.add_argument(
            f"--delta-{old}-gbps", dest=f"delta_{old}_gbps", type=float, action=Deprecated, use=new
        )


def run(args: argparse.Namespace) -> int:
    path = Path(args.model)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"weightwire plan: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(config, dict):
        print(f"weightwire plan: {path} is not a JSON object (a config.json)", file=sys.stderr)
        return 2
    replicas, tp = args.engines
    ep = args.ep or (tp if is_moe(config) else 1)
    if args.trainers < 1 or args.nic_gbps <= 0 or tp % ep:
        print("weightwire plan: need trainers >= 1, nic-gbit > 0, ep dividing T", file=sys.stderr)
        return 2
    topo = Topology(args.trainers, replicas, tp, ep, args.nic_gbps)
    try:
        report = run_plan(
            config,
            topo,
            args.dtype,
            bucket_bytes=int(args.bucket_mb * (1 << 20)),
            tail_bytes=int(args.tail_mb * (1 << 20)),
            max_write_bytes=int(args.max_write_mb * (1 << 20)),
            bucket_overhead_s=args.bucket_overhead_us * 1e-6,
            pack_Bps=args.pack_gbps * 1e9,
            write_overhead_s=args.write_overhead_us * 1e-6,
            rel_tol=args.sim_tol,
            model=path.stem,
            progress=Progress(args.progress_after),
            staging_buckets=args.staging_buckets,
            delta_density=args.delta_density,
            delta_encode_Bps=args.delta_encode_gbps * 1e9,
            delta_verify_Bps=args.delta_verify_gbps * 1e9,
            delta_apply_Bps=args.delta_apply_gbps * 1e9,
        )
    except PlanError as exc:
        print(f"weightwire plan: {exc}", file=sys.stderr)
        return 1
    j = report.as_json(args.top)
    if args.plot:
        plot(report, args.plot)
        j["plot"] = args.plot
    print(json.dumps(j, indent=2) if args.json else render(j))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightwire plan", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
