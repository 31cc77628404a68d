"""The arguments of `weightwire bench gpu` (argparse only: no torch at import)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="data/models/qwen3-30b-a3b.json",
        help="a Hugging Face config.json (relative paths also from the repository)",
    )
    p.add_argument(
        "--layers",
        default="auto",
        help="decoder layers to use (auto: the config's, fewer if a rank would not fit)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key (JSON value), e.g. to shrink the model: hidden_size=256",
    )
    p.add_argument("--dest", choices=["bf16", "fp8"], default="bf16", help="engine weights")
    p.add_argument(
        "--pairs",
        default="2x2,1x1",
        help="TxE runs: T trainer ranks (FSDP-T) -> E engine ranks (TP-E), T+E GPUs each",
    )
    p.add_argument(
        "--place",
        metavar="T0,T1:E0,E1",
        help="GPU of each trainer and engine rank (default: one GPU each, in order, "
        "wrapping around when there are fewer GPUs)",
    )
    p.add_argument("--versions", type=int, default=3, help="measured versions (after a warm-up)")
    p.add_argument(
        "--replica",
        action="store_true",
        help="instead: 1 -> 1 through the CPU replica (staging in pinned host memory), over "
        "tcp to a second daemon, into the engine GPU; each stage's GB/s",
    )
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (table: stderr)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: gloo and tcp, to exercise the program where there is no GPU",
    )
    p.add_argument(
        "--staging",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="trainer staging (auto: on the GPU with GPU tensors)",
    )
    p.add_argument(
        "--staging-buckets",
        default="4",
        metavar="N[,N...]",
        help="trainer staging: a ring of N bucket slots (0: the whole send). Several values "
        "(e.g. 0,2,4) make one run per value for each pair, each compared with the first. "
        "N:packed posts each bucket once packed (not before, the copies waiting on the GPU "
        "for the pack counter), N:events or N:landing waits for slots the older ways "
        "(default: GPU slot counters and the pack counter)",
    )
    p.add_argument(
        "--zero-copy",
        action="store_true",
        help="trainers register their GPU tensors zero-copy (the daemon reads their memory "
        "for every part the engines take unchanged and contiguous, without packing)",
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="colocated trainers pack straight into their engines' memory (buckets whose "
        "writes all land on the trainer's own GPU): no staging hop, no copy",
    )
    p.add_argument(
        "--trainer-layout",
        choices=["fsdp", "full"],
        default="fsdp",
        help="trainers hold FSDP dim-0 shards, or every rank the full tensors",
    )
    p.add_argument("--bucket-mb", type=int, default=1024, help="baseline broadcast bucket")
    p.add_argument("--no-baseline", action="store_true", help="weightwire only")
    p.add_argument("--link-mb", type=int, default=1024, help="bytes per link-rate copy")
    p.add_argument("--link-reps", type=int, default=5, help="timed copies per link rate")
    p.add_argument("--workdir", help="daemon and rank logs here (default: a temporary dir)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per step of a rank")
    p.add_argument(
        "--time-budget",
        type=float,
        default=0,
        help="seconds for the whole command: measure fewer versions rather than overrun",
    )
    p.add_argument(
        "--daemon-flag",
        action="append",
        metavar="KEY=VALUE",
        help="extra weightwired flag for every daemon, e.g. bucket-bytes=536870912",
    )
