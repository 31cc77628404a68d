"""`weightwire bench gpu`: weightwire against the NCCL broadcast baseline on one GPU machine.

A Qwen3-30B-A3B-shaped model (real HF names and shapes, random BF16 weights; BF16 or FP8
engines): FSDP trainer ranks -> TP engine ranks through one daemon (the cuda transport,
CUDA IPC), and, in the same run, the baseline RL frameworks use today (trainer rank 0
gathers full tensors and broadcasts each bucket with NCCL to every engine rank, which
copies its slices in). Both verified bitwise, every version. Also the copy rate of every
link, measured in the same run, a per-stage breakdown, a Chrome trace (`--trace`), and the
CPU-replica path (`--replica`: GPU -> pinned replica -> tcp -> another daemon -> GPU).

Nothing here imports torch until a run starts: `--device cpu` (gloo, tcp) exercises all
of it on a machine without a GPU.

Modules: `cli` (arguments), `launcher` (daemon, rank processes, versions), `rank` (one
rank's process), `model` (config, contents, recipes, baseline buckets, sizes), `links`
(link rates), `report` (medians, table, JSON, trace).
"""

from __future__ import annotations

from typing import Any


def run(args: Any) -> int:
    from .launcher import main

    return main(args)
