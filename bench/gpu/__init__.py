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

Modules:

- `cli`: the arguments;
- `launcher`: the command;
- `runs`: one TxE or replica run, version by version;
- `processes`: the daemon and rank processes;
- `sizing`: layers that fit, and rank placement;
- `budget`: the time budget;
- `errors`;
- `probe` and `links`: the link rates;
- `rank`: one rank's process (`rank_base`, `rank_trainer`, `rank_engine`);
- `model`: config, contents, recipes, baseline buckets and sizes;
- `report`: medians, links, targets and JSON;
- `text`: the table;
- `chrome_trace`: `--trace`.
"""

from __future__ import annotations

from typing import Any


def run(args: Any) -> int:
    from .launcher import main

    return main(args)
