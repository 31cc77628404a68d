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
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightwire.protocol.errors import PlanError
from weightwire.protocol.plan import NodePlan
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import DestTensor, SourceTensor

if TYPE_CHECKING:  # numpy and the planner load only when the command runs
    import numpy as np

    from weightwire.plan.bound import Bound
    from weightwire.plan.planner import EngineRank, TrainerRank
    from weightwire.plan.simulate import SimResult

DTYPES = {"fp8": "fp8", "bf16": "bfloat16", "bfloat16": "bfloat16"}
ALIGN = 256  # engine tensors start on 256-byte boundaries in their region


@dataclass(frozen=True)
class Topology:
    trainers: int
    replicas: int
    tp: int
    ep: int
    nic_gbps: float  # Gbit/s per GPU NIC, trainers and engines alike

    @property
    def engines(self) -> int:
        return self.replicas * self.tp

    @property
    def nic_Bps(self) -> float:
        return self.nic_gbps * 1e9 / 8


@dataclass
class Timings:
    """Wall and CPU seconds per phase (CPU too: a shared machine's wall time says little)."""

    phases: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    _cpu0: float = field(default_factory=time.process_time)

    def run(self, name: str, t0: float) -> float:
        now, cpu = time.perf_counter(), time.process_time()
        self.phases[name] = self.phases.get(name, 0.0) + now - t0
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self._cpu0
        self._cpu0 = cpu
        return now


@dataclass
class Flows:
    """Every write of a plan, as arrays (source = trainer index, destination = engine index)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    bucket: np.ndarray
    packed: dict[tuple[int, int], float]
    staging: list[int]  # staging bytes per trainer

    @property
    def writes(self) -> int:
        return int(self.src.shape[0])


def parse_engines(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"--engines wants RxT (replicas x GPUs), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def is_moe(config: Mapping[str, Any]) -> bool:
    return bool(config.get("num_experts") or config.get("n_routed_experts"))


def trainer_ranks(config: Mapping[str, Any], n: int, dtype: str = "bfloat16") -> list[TrainerRank]:
    """N trainer ranks, each holding every HF tensor whole (gathered before sending)."""
    from weightwire.plan.planner import TrainerRank
    from weightwire.plan.rules import hf_tensors

    held = tuple(
        SourceTensor(name=t.name, dtype=t.dtype, shape=t.shape)  # type: ignore[arg-type]
        for t in hf_tensors(config, dtype)
    )
    return [TrainerRank(f"trainer-{i}", i, held) for i in range(n)]


def engine_ranks(
    config: Mapping[str, Any], topo: Topology, dest_dtype: str, replicas: Sequence[int]
) -> list[EngineRank]:
    """The engine GPUs of the given replicas, rank replica * tp + tp_rank, each on a node of
    its own (one NIC per GPU), its SGLang tensors packed into one region."""
    from weightwire.plan.bound import layout_of
    from weightwire.plan.planner import EngineRank
    from weightwire.plan.rules import engine_tensors

    per_tp: list[tuple[tuple[DestTensor, ...], int]] = []
    for r in range(topo.tp):
        placed: list[DestTensor] = []
        offset = 0
        for t in engine_tensors(config, layout_of(config, topo.tp, r, topo.ep, dest_dtype)):
            placed.append(
                DestTensor(
                    name=t.name,
                    dtype=t.dtype,  # type: ignore[arg-type]
                    shape=t.shape,
                    region=1,
                    offset=offset,
                    pieces=t.pieces,
                )
            )
            offset += -(-placed[-1].nbytes // ALIGN) * ALIGN
        per_tp.append((tuple(placed), offset))
    out = []
    for rep in replicas:
        for r, (tensors, length) in enumerate(per_tp):
            node = f"engine-{rep}-{r}"
            region = RegionDescriptor(id=1, node=node, kind="gpu", length=max(length, 1))
            out.append(EngineRank(node, rep * topo.tp + r, tensors, (region,)))
    return out


def flows_of(plans: Mapping[str, NodePlan], trainers: int) -> Flows:
    import numpy as np

    src: list[int] = []
    dst: list[int] = []
    nbytes: list[int] = []
    bucket: list[int] = []
    packed: dict[tuple[int, int], float] = {}
    staging = [0] * trainers
    for node_plan in plans.values():
        for rp in node_plan.sends:
            staging[rp.rank] = rp.staging_bytes
            for b in rp.buckets:
                packed[(rp.rank, b.index)] = float(b.nbytes)
                for w in b.writes:
                    src.append(rp.rank)
                    dst.append(w.dst_rank)
                    nbytes.append(w.nbytes)
                    bucket.append(b.index)
    return Flows(
        src=np.asarray(src, dtype=np.int64),
        dst=np.asarray(dst, dtype=np.int64),
        nbytes=np.asarray(nbytes, dtype=np.float64),
        bucket=np.asarray(bucket, dtype=np.int64),
        packed=packed,
        staging=staging,
    )


@dataclass
class Report:
    model: str
    topo: Topology
    dtype: str
    bound: Bound
    sim: SimResult
    flows: Flows
    options: dict[str, Any]
    timings: Timings
    wall_s: float = 0.0

    def as_json(self, top: int) -> dict[str, Any]:

        b, s = self.bound, self.sim
        tb, eb = s.src_bytes, s.dst_bytes
        return {
            "model": self.model,
            "trainers": self.topo.trainers,
            "engines": f"{self.topo.replicas}x{self.topo.tp}",
            "engine_replicas": self.topo.replicas,
            "engine_tp": self.topo.tp,
            "engine_ep": self.topo.ep,
            "dtype": self.dtype,
            "nic_gbps": self.topo.nic_gbps,
            "bytes_total": int(self.flows.nbytes.sum()),
            "bytes_needed": b.total_bytes,
            "bound_s": b.seconds,
            "bound_engine_s": b.engine_s,
            "bound_trainer_s": b.trainer_s,
            "bound_limited_by": b.limited_by,
            "simulated_s": s.seconds,
            "efficiency": b.seconds / s.seconds if s.seconds > 0 else 1.0,
            "trainer_bytes": _stats(tb),
            "engine_bytes": _stats(eb),
            "busiest_trainers": _top(tb, s.src_finish, top, "trainer"),
            "busiest_engines": _top(eb, s.dst_finish, top, "engine", self.topo.tp),
            "writes": self.flows.writes,
            "flows": s.flows,
            "pairs": s.pairs,
            "buckets_max": max((k[1] + 1 for k in self.flows.packed), default=0),
            "staging_bytes_max": max(self.flows.staging, default=0),
            "simulation_steps": s.steps,
            "options": self.options,
            "timings_s": {k: round(v, 3) for k, v in self.timings.phases.items()},
            "cpu_s": {k: round(v, 3) for k, v in self.timings.cpu.items()},
            "wall_s": round(self.wall_s, 3),
        }


def _stats(x: np.ndarray) -> dict[str, float]:
    import numpy as np

    if x.size == 0:
        return {}
    return {
        "min": float(x.min()),
        "median": float(np.median(x)),
        "mean": float(x.mean()),
        "max": float(x.max()),
        "max_over_mean": float(x.max() / x.mean()) if x.mean() > 0 else 0.0,
    }


def _top(
    nbytes: np.ndarray, finish: np.ndarray, k: int, kind: str, tp: int = 0
) -> list[dict[str, Any]]:
    order = sorted(range(nbytes.shape[0]), key=lambda i: (-nbytes[i], i))[:k]
    out = []
    for i in order:
        name = f"{kind}-{i}" if kind == "trainer" else f"engine-{i // tp}-{i % tp}"
        out.append({"nic": name, "bytes": int(nbytes[i]), "finish_s": float(finish[i])})
    return out


def run_plan(
    config: Mapping[str, Any],
    topo: Topology,
    dtype: str,
    *,
    bucket_bytes: int = 256 << 20,
    max_write_bytes: int = 32 << 20,
    bucket_overhead_s: float = 100e-6,
    pack_Bps: float = 0.0,
    write_overhead_s: float = 0.0,
    rel_tol: float = 1e-4,
    model: str = "",
    progress: Any = None,
) -> Report:
    """Plan and simulate; raises PlanError when the layout cannot be planned."""
    import numpy as np

    from weightwire.plan.bound import bound_of, layout_of, received_bytes
    from weightwire.plan.planner import PlanOptions, plan
    from weightwire.plan.simulate import simulate

    dest = DTYPES[dtype]
    timings = Timings()
    t_start = t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    per_rank = [
        received_bytes(_engine_tensors(config, layout_of(config, topo.tp, r, topo.ep, dest)))
        for r in range(topo.tp)
    ]
    bound = bound_of(per_rank * topo.replicas, topo.trainers, topo.nic_Bps)
    t0 = timings.run("bound", t0)
    trainers = trainer_ranks(config, topo.trainers)
    engines = engine_ranks(config, topo, dest, range(topo.replicas))
    t0 = timings.run("layout", t0)
    pieces = sum(len(t.pieces or ()) for e in engines for t in e.tensors)
    say(f"planning: {topo.trainers} trainer ranks x {pieces:,} engine pieces")
    options = PlanOptions(bucket_bytes=bucket_bytes, max_write_bytes=max_write_bytes)
    plans = plan("plan", trainers, engines, options)
    t0 = timings.run("planner", t0)
    flows = flows_of(plans, topo.trainers)
    del plans
    t0 = timings.run("flows", t0)
    say(f"simulating {flows.writes} writes")
    sim = simulate(
        flows.src,
        flows.dst,
        flows.nbytes,
        flows.bucket,
        np.full(topo.trainers, topo.nic_Bps),
        np.full(topo.engines, topo.nic_Bps),
        packed_bytes=flows.packed,
        pack_rate=pack_Bps if pack_Bps > 0 else math.inf,
        bucket_overhead_s=bucket_overhead_s,
        writes=np.ones(flows.writes),
        write_overhead_s=write_overhead_s,
        rel_tol=rel_tol,
    )
    timings.run("simulate", t0)
    opts = {
        "bucket_mb": bucket_bytes / (1 << 20),
        "max_write_mb": max_write_bytes / (1 << 20),
        "bucket_overhead_us": bucket_overhead_s * 1e6,
        "pack_gbps": pack_Bps / 1e9 if pack_Bps > 0 else None,
        "write_overhead_us": write_overhead_s * 1e6,
        "sim_rel_tol": rel_tol,
    }
    report = Report(model, topo, dtype, bound, sim, flows, opts, timings)
    report.wall_s = time.perf_counter() - t_start
    return report


def _engine_tensors(config: Mapping[str, Any], layout: Any) -> list[Any]:
    from weightwire.plan.rules import engine_tensors

    return engine_tensors(config, layout)


# --------------------------------------------------------------------------- output
def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def render(j: Mapping[str, Any]) -> str:
    lines = [
        f"model {j['model']}  {j['dtype']} destinations  trainers {j['trainers']}  "
        f"engines {j['engines']} (ep {j['engine_ep']})  NIC {j['nic_gbps']:g} Gbit/s per GPU",
        f"bytes to send   {_gb(j['bytes_total'])} in {j['writes']:,} writes "
        f"({j['flows']:,} source/destination/bucket flows, {j['pairs']:,} NIC pairs, "
        f"up to {j['buckets_max']} buckets per trainer)",
    ]
    for side in ("trainer", "engine"):
        s = j[f"{side}_bytes"]
        lines.append(
            f"{side + ' NICs':<15} min {_gb(s['min'])}  median {_gb(s['median'])}  "
            f"mean {_gb(s['mean'])}  max {_gb(s['max'])}  (max/mean {s['max_over_mean']:.3f})"
        )
    lines.append(
        "busiest NICs    "
        + "  ".join(
            f"{t['nic']} {_gb(t['bytes'])} (done {t['finish_s']:.3f} s)"
            for t in (j["busiest_engines"][:3] + j["busiest_trainers"][:2])
        )
    )
    lines += [
        f"bound           {j['bound_s']:.4f} s  ({j['bound_limited_by']}: busiest engine "
        f"{j['bound_engine_s']:.4f} s, all trainers {j['bound_trainer_s']:.4f} s)",
        f"simulated       {j['simulated_s']:.4f} s  (bucket {j['options']['bucket_mb']:g} MB, "
        f"{j['options']['bucket_overhead_us']:g} us per bucket)",
        f"efficiency      {j['efficiency']:.3f}  (bound / simulated)",
        "took            "
        + ", ".join(f"{k} {v:.1f} s" for k, v in j["timings_s"].items())
        + f"; {j['wall_s']:.1f} s in all ({sum(j['cpu_s'].values()):.1f} s CPU)",
    ]
    return "\n".join(lines)


def plot(report: Report, path: str) -> None:
    """Per-NIC load, trainers above and engine GPUs below, on one scale: bars are the bytes
    each NIC carries (left axis, GB; right axis, the same in seconds at its line rate),
    dots are when the simulation had its last byte through, the dashed line is the bound."""
    import numpy as np

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from exc
    s, b, t = report.sim, report.bound, report.topo
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), constrained_layout=True)
    top = max(s.seconds, b.seconds) * 1.3
    for ax, nbytes, finish, label, rate in (
        (axes[0], s.src_bytes, s.src_finish, f"trainer GPU NICs ({t.trainers})", b.trainer_nic_Bps),
        (axes[1], s.dst_bytes, s.dst_finish, f"engine GPU NICs ({t.engines})", b.engine_nic_Bps),
    ):
        gb = rate / 1e9  # GB per second of line rate
        x = np.arange(nbytes.shape[0])
        ax.bar(
            x,
            nbytes / 1e9,
            width=0.9 if x.size < 64 else 1.0,
            color="#4C72B0",
            label="bytes through the NIC",
        )
        ax.plot(
            x,
            finish * gb,
            ".",
            ms=4 if x.size < 200 else 2.5,
            color="#C44E52",
            label="simulated: last byte through",
        )
        ax.axhline(
            b.seconds * gb, color="k", ls="--", lw=1, label=f"busiest-NIC bound {b.seconds:.3f} s"
        )
        ax.axhline(
            s.seconds * gb, color="#C44E52", ls=":", lw=1, label=f"simulated {s.seconds:.3f} s"
        )
        ax.set_xlim(-0.5, x.size - 0.5)
        ax.set_ylim(0, top * gb)
        ax.set_xlabel(label)
        ax.set_ylabel("GB")
        sec = ax.secondary_yaxis("right", functions=(lambda v, g=gb: v / g, lambda v, g=gb: v * g))
        sec.set_ylabel(f"seconds at {t.nic_gbps:g} Gbit/s")
        ax.legend(loc="upper left", ncol=4, fontsize=8, framealpha=0.9)
    fig.suptitle(
        f"{report.model}, {report.dtype}: {t.trainers} trainers -> {t.replicas}x{t.tp} engine "
        f"GPUs, {t.nic_gbps:g} Gbit/s per GPU: simulated {s.seconds:.3f} s, "
        f"bound {b.seconds:.3f} s, efficiency {b.seconds / s.seconds:.3f}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face config.json")
    p.add_argument("--trainers", type=int, required=True, help="trainer GPUs (one NIC each)")
    p.add_argument(
        "--engines", type=parse_engines, required=True, help="RxT: R engine replicas of T GPUs"
    )
    p.add_argument("--nic-gbps", type=float, required=True, help="NIC rate per GPU, Gbit/s")
    p.add_argument("--dtype", choices=["fp8", "bf16"], required=True, help="engine weights")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: T for MoE)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="plan bucket size (MiB)")
    p.add_argument("--max-write-mb", type=float, default=32.0, help="largest write (MiB)")
    p.add_argument("--bucket-overhead-us", type=float, default=100.0, help="fixed cost per bucket")
    p.add_argument("--write-overhead-us", type=float, default=0.0, help="fixed cost per write")
    p.add_argument(
        "--pack-gbps", type=float, default=0.0, help="packing rate, GB/s (0: instantaneous)"
    )
    p.add_argument("--sim-tol", type=float, default=1e-4, help="simulator event window")
    p.add_argument("--top", type=int, default=5, help="busiest NICs listed")
    p.add_argument("--plot", metavar="FILE.png", help="per-NIC bytes and finish times")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    path = Path(args.model)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"weightwire plan: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    replicas, tp = args.engines
    ep = args.ep or (tp if is_moe(config) else 1)
    if args.trainers < 1 or args.nic_gbps <= 0 or tp % ep:
        print("weightwire plan: need trainers >= 1, nic-gbps > 0, ep dividing T", file=sys.stderr)
        return 2
    topo = Topology(args.trainers, replicas, tp, ep, args.nic_gbps)
    quiet = args.json
    try:
        report = run_plan(
            config,
            topo,
            args.dtype,
            bucket_bytes=int(args.bucket_mb * (1 << 20)),
            max_write_bytes=int(args.max_write_mb * (1 << 20)),
            bucket_overhead_s=args.bucket_overhead_us * 1e-6,
            pack_Bps=args.pack_gbps * 1e9,
            write_overhead_s=args.write_overhead_us * 1e-6,
            rel_tol=args.sim_tol,
            model=path.stem,
            progress=None if quiet else lambda m: print(f"... {m}", file=sys.stderr, flush=True),
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
