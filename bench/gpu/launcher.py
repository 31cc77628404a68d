"""The launcher of `weightwire bench gpu`: the device, each TxE run (`runs`) within
--time-budget, then the table, the JSON object and the trace."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import chrome_trace, report
from . import model as M
from .budget import Budget, on_signal
from .errors import Interrupted
from .probe import probe
from .processes import NO_MULTICAST
from .runs import log, run_pair, run_replica
from .sizing import fit_layers
from .text import render

__all__ = ["fit_layers", "main"]


def main(args: Any) -> int:
    os.environ.update(NO_MULTICAST)
    if args.time_budget:
        Budget.deadline = time.monotonic() + args.time_budget
    signal.signal(signal.SIGTERM, on_signal)
    base_cfg = M.load_config(args.model, None, args.set or ())
    if args.layers != "auto":
        base_cfg["num_hidden_layers"] = int(args.layers)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ww-bench-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = probe(args.device, [], 0, 0, False)
    gpus = info["devices"]["gpus"]
    if args.device == "cuda" and not gpus:
        log("weightwire bench gpu: no GPU visible (use --device cpu to exercise the program)")
        return 2
    result: dict[str, Any] = {
        "benchmark": "weightwire bench gpu",
        "device": args.device,
        "gpus": [g["name"] for g in gpus],
        "device_name": gpus[0]["name"] if gpus else "cpu",
        "torch": info["devices"]["torch"],
        "cuda": info["devices"]["cuda"],
        "nccl": info["devices"].get("nccl"),
        "model": {
            "config": str(args.model),
            "architecture": (base_cfg.get("architectures") or ["?"])[0],
            "layers_in_config": int(base_cfg["num_hidden_layers"]),
            "overrides": list(args.set or ()),
        },
        "dest": args.dest,
        "trainer_layout": args.trainer_layout,
        "versions": args.versions,
        "workdir": str(workdir),
        "runs": [],
    }
    log(
        f"weightwire bench gpu on {args.device}: "
        + (", ".join(f"GPU{g['index']} {g['name']}" for g in gpus) or "no GPU (CPU run)")
    )
    jobs: list[tuple[dict[str, Any], Any]] = []
    if args.replica:
        head = {"pair": "1x1 replica", "mode": "replica", "trainers": 1, "engines": 1}
        jobs.append((head, lambda: run_replica(args, base_cfg, info, workdir)))
    else:
        rings = [ring_spec(n) for n in str(args.staging_buckets).split(",") if n.strip()]
        rings = rings or [(4, "")]
        for pair in filter(None, args.pairs.split(",")):
            t, _, e = pair.lower().partition("x")
            for n, wait in rings:
                name = f"{t}x{e}" + (f" ring {n}" if len(rings) > 1 else "")
                name += f" {wait}" if wait else ""
                head = {"pair": name, "mode": "pair", "trainers": int(t), "engines": int(e)}
                jobs.append(
                    (
                        head,
                        lambda t=int(t), e=int(e), n=n, w=wait, name=name: run_pair(
                            args, base_cfg, t, e, info, workdir, ring=n, name=name, slot_wait=w
                        ),
                    )
                )
    for i, (head, job) in enumerate(jobs):
        if Budget.deadline is not None:
            Budget.run_deadline = time.monotonic() + Budget.left() / (len(jobs) - i)
        if Budget.interrupted or Budget.left() < 45:
            why = "interrupted" if Budget.interrupted else "--time-budget spent"
            result["runs"].append({**head, "error": f"not run: {why}"})
            continue
        try:
            result["runs"].append(job())
        except Interrupted as exc:
            result["runs"].append({**head, "error": str(exc)})
    report.finish(result)
    if args.trace:
        Path(args.trace).write_text(json.dumps(chrome_trace.trace(result)))
        log(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    text = render(result)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(result))
    else:
        print(text)
    return 0 if result["ok"] else 1


def ring_spec(text: str) -> tuple[int, str]:
    """`--staging-buckets` value: "N" (slots freed as the trainer chooses: GPU counters
    where it can, buckets posted before they are packed) or "N:counters", "N:packed",
    "N:events", "N:landing" (`rank --slot-wait`)."""
    n, _, wait = text.strip().partition(":")
    if wait not in ("", "counters", "packed", "events", "landing"):
        raise SystemExit(
            f"--staging-buckets {text!r}: the slot wait is counters, packed, events or landing"
        )
    return int(n), wait
