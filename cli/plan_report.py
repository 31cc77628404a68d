"""`weightwire plan`'s report: the job planned with the real planner, its flows simulated,
the busiest-NIC bound, and the figures as a JSON object."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from .plan_flows import Flows, flows_of
from .plan_ranks import Topology, engine_ranks, trainer_ranks

if TYPE_CHECKING:  # numpy and the planner load only when the command runs
    import numpy as np

    from weightwire.plan.bound import Bound
    from weightwire.plan.simulate import SimResult

DTYPES = {"fp8": "fp8", "bf16": "bfloat16", "bfloat16": "bfloat16"}


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


class Progress:
    """Phase lines on stderr, only once a plan has taken `after_s` (short plans stay quiet)."""

    def __init__(self, after_s: float = 2.0, out: TextIO | None = None) -> None:
        self.after_s = after_s
        self.out = out
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.t0
        if elapsed >= self.after_s:
            print(f"... {elapsed:5.1f} s  {msg}", file=self.out or sys.stderr, flush=True)


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
    caveats: list[str] = field(default_factory=list)  # plan.rules.caveats of the layouts
    delta: dict[str, Any] | None = None

    def as_json(self, top: int) -> dict[str, Any]:
        import numpy as np

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
            "staging_per_trainer": _stats(np.asarray(self.flows.staging, dtype=np.float64)),
            "staging_ring_slots": self.flows.ring_slots,
            "staging_ring_per_trainer": _stats(np.asarray(self.flows.ring, dtype=np.float64)),
            "plan_hash": self.flows.plan_hash,
            "simulation_steps": s.steps,
            "options": self.options,
            "timings_s": {k: round(v, 3) for k, v in self.timings.phases.items()},
            "cpu_s": {k: round(v, 3) for k, v in self.timings.cpu.items()},
            "wall_s": round(self.wall_s, 3),
            "caveats": self.caveats,
            **({"delta": self.delta} if self.delta is not None else {}),
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
    tail_bytes: int = 64 << 20,
    max_write_bytes: int = 32 << 20,
    bucket_overhead_s: float = 100e-6,
    pack_Bps: float = 0.0,
    write_overhead_s: float = 0.0,
    rel_tol: float = 1e-4,
    model: str = "",
    progress: Any = None,
    staging_buckets: int = 4,
    delta_density: float | None = None,
    delta_encode_Bps: float = 400e9,
    delta_verify_Bps: float = 1000e9,
    delta_apply_Bps: float = 0.0,
) -> Report:
    """Plan and simulate; raises PlanError when the layout cannot be planned. `progress`
    is told each phase as it starts. The collector is off meanwhile: everything built
    lives to the end, and at Kimi-K2's millions of objects its passes cost seconds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _run_plan(
            config,
            topo,
            dtype,
            bucket_bytes=bucket_bytes,
            tail_bytes=tail_bytes,
            max_write_bytes=max_write_bytes,
            bucket_overhead_s=bucket_overhead_s,
            pack_Bps=pack_Bps,
            write_overhead_s=write_overhead_s,
            rel_tol=rel_tol,
            model=model,
            progress=progress,
            staging_buckets=staging_buckets,
            delta_density=delta_density,
            delta_encode_Bps=delta_encode_Bps,
            delta_verify_Bps=delta_verify_Bps,
            delta_apply_Bps=delta_apply_Bps,
        )
    finally:
        if enabled:
            gc.enable()


def _run_plan(
    config: Mapping[str, Any],
    topo: Topology,
    dtype: str,
    *,
    bucket_bytes: int,
    tail_bytes: int,
    max_write_bytes: int,
    bucket_overhead_s: float,
    pack_Bps: float,
    write_overhead_s: float,
    rel_tol: float,
    model: str,
    progress: Any,
    staging_buckets: int,
    delta_density: float | None,
    delta_encode_Bps: float,
    delta_verify_Bps: float,
    delta_apply_Bps: float,
) -> Report:
    import numpy as np

    from weightwire.plan.bound import bound_of, layout_of, received_bytes
    from weightwire.plan.planner import PlanOptions, plan
    from weightwire.plan.rules import caveats
    from weightwire.plan.simulate import simulate

    dest = DTYPES[dtype]
    timings = Timings()
    t_start = t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    say("engine layouts and the bound")
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
    options = PlanOptions(
        bucket_bytes=bucket_bytes,
        tail_bytes=tail_bytes,
        max_write_bytes=max_write_bytes,
        share_keys=delta_density is not None,  # as the daemon plans a delta-capable job
    )
    plans = plan("plan", trainers, engines, options, progress=say)
    t0 = timings.run("planner", t0)
    flows = flows_of(plans, topo.trainers, staging_buckets)
    del plans
    t0 = timings.run("flows", t0)
    say(f"simulating {flows.writes:,} writes")
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
        "tail_mb": tail_bytes / (1 << 20),
        "max_write_mb": max_write_bytes / (1 << 20),
        "bucket_overhead_us": bucket_overhead_s * 1e6,
        "pack_gbps": pack_Bps / 1e9 if pack_Bps > 0 else None,
        "write_overhead_us": write_overhead_s * 1e6,
        "sim_rel_tol": rel_tol,
    }
    report = Report(model, topo, dtype, bound, sim, flows, opts, timings)
    report.caveats = caveats(config, layout_of(config, topo.tp, 0, topo.ep, dest))
    if delta_density is not None:
        report.delta = simulate_delta(
            flows,
            sim,
            topo,
            dtype,
            delta_density,
            pack_Bps,
            delta_encode_Bps,
            delta_verify_Bps,
            apply_Bps=delta_apply_Bps,
            bucket_overhead_s=bucket_overhead_s,
            write_overhead_s=write_overhead_s,
            rel_tol=rel_tol,
        )
        timings.run("delta", t0)
    report.wall_s = time.perf_counter() - t_start
    return report


def simulate_delta(
    flows: Flows,
    dense: SimResult,
    topo: Topology,
    dtype: str,
    density: float,
    pack_Bps: float,
    encode_Bps: float,
    verify_Bps: float,
    *,
    apply_Bps: float = 0.0,
    **sim_args: Any,
) -> dict[str, Any]:
    """The same plan's delta version at `density`: payloads and trailers instead of dense
    writes, the senders' compare/encode added to packing, and each engine's verification
    (a checksum over every byte it receives) bucket by bucket: each (source, bucket)
    flow checked once it landed, one at a time per engine, overlapped with the flows
    still on their way; what is left after the engine's last byte is on the tail
    (`verify_s`). With `apply_Bps` (GB/s of dense input) each payload's decode and
    scatter is in the same queue (0: not modelled)."""
    import numpy as np

    from weightwire.plan.delta_sim import delta_flows, verify_queue
    from weightwire.plan.simulate import simulate

    width = 1 if dtype == "fp8" else 2
    df = delta_flows(flows.src, flows.dst, flows.nbytes, flows.bucket, density=density, width=width)
    per_byte = (1 / pack_Bps if pack_Bps > 0 else 0.0) + (1 / encode_Bps if encode_Bps else 0.0)
    sim = simulate(
        df.src,
        df.dst,
        df.nbytes,
        df.bucket,
        np.full(topo.trainers, topo.nic_Bps),
        np.full(topo.engines, topo.nic_Bps),
        packed_bytes=flows.packed,
        pack_rate=1 / per_byte if per_byte else math.inf,
        writes=df.writes,
        land=True,
        **sim_args,
    )
    verify_busy = (
        float(np.max(dense.dst_bytes)) / verify_Bps if verify_Bps and dense.dst_bytes.size else 0.0
    )
    total = float(sim.seconds)
    per_dense = 1 / verify_Bps if verify_Bps else 0.0
    per_applied = 1 / apply_Bps if apply_Bps > 0 else 0.0
    apply_busy = 0.0
    if (per_dense or per_applied) and sim.flow_land is not None and df.dense is not None:
        assert df.applied is not None
        # the dense bytes each simulated (source, destination, bucket) flow stands for
        nd, nb = topo.engines, int(df.bucket.max()) + 1
        key = (df.src * nd + df.dst) * nb + df.bucket
        assert sim.flow_src is not None and sim.flow_dst is not None
        assert sim.flow_bucket is not None
        fkey = (sim.flow_src * nd + sim.flow_dst) * nb + sim.flow_bucket
        uniq, inv = np.unique(key, return_inverse=True)
        at = np.searchsorted(uniq, fkey)
        checked = np.bincount(inv.reshape(-1), weights=df.dense)[at]
        applied = np.bincount(inv.reshape(-1), weights=df.applied)[at]
        work = checked * per_dense + applied * per_applied
        done = verify_queue(sim.flow_dst, sim.flow_land, work, topo.engines)
        apply_busy = (
            float(np.bincount(sim.flow_dst, weights=applied, minlength=topo.engines).max())
            * per_applied
        )
        total = max(total, float(done.max()))
    verify = total - float(sim.seconds)
    return {
        "density": density,
        "element_bytes": width,
        "bytes_total": int(df.nbytes.sum()),
        "bytes_ratio": float(df.nbytes.sum() / flows.nbytes.sum()) if flows.nbytes.sum() else 0.0,
        "payloads": df.payloads,
        "dense_groups": df.dense_groups,
        "network_s": float(sim.seconds),
        "encode_gbps": encode_Bps / 1e9,
        "verify_gbps": verify_Bps / 1e9,
        "verify_s": verify,
        "verify_busy_s": verify_busy,
        "apply_gbps": apply_Bps / 1e9 if apply_Bps > 0 else None,
        "apply_busy_s": apply_busy,
        "verify_overlapped": True,
        "simulated_s": total,
        "dense_simulated_s": float(dense.seconds),
        "speedup": float(dense.seconds) / total if total > 0 else 0.0,
        "shadow_bytes_max": max(flows.staging, default=0),
        "busiest_engine_bytes": float(np.max(sim.dst_bytes)) if sim.dst_bytes.size else 0.0,
    }


def _engine_tensors(config: Mapping[str, Any], layout: Any) -> list[Any]:
    from weightwire.plan.rules import engine_tensors

    return engine_tensors(config, layout)
