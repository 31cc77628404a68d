"""The text `weightwire plan` prints, from its report's JSON object."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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
    st = j["staging_per_trainer"]
    if st:
        lines.append(
            f"staging         per trainer rank (its whole send, staged at once): "
            f"max {_gb(st['max'])}  median {_gb(st['median'])}  min {_gb(st['min'])}"
        )
    ring = j.get("staging_ring_per_trainer")
    if ring and j.get("staging_ring_slots"):
        lines.append(
            f"staging ring    per trainer rank, {j['staging_ring_slots']} bucket slots "
            f"(Trainer(staging_buckets=...)): "
            f"max {_gb(ring['max'])}  median {_gb(ring['median'])}  min {_gb(ring['min'])}"
        )
    lines += [
        f"bound           {j['bound_s']:.4f} s  ({j['bound_limited_by']}: busiest engine "
        f"{j['bound_engine_s']:.4f} s, all trainers {j['bound_trainer_s']:.4f} s)",
        f"simulated       {j['simulated_s']:.4f} s  (bucket {j['options']['bucket_mb']:g} MB, "
        f"tail {j['options'].get('tail_mb', 0):g} MB, "
        f"{j['options']['bucket_overhead_us']:g} us per bucket)",
        f"efficiency      {j['efficiency']:.3f}  (bound / simulated)",
        f"plan hash       {j['plan_hash']}",
        "took            "
        + ", ".join(f"{k} {v:.1f} s" for k, v in j["timings_s"].items())
        + f"; {j['wall_s']:.1f} s in all ({sum(j['cpu_s'].values()):.1f} s CPU)",
    ]
    lines += [f"warning         {c}" for c in j.get("caveats", ())]
    d = j.get("delta")
    if d:
        lines.append(
            f"delta           {d['simulated_s']:.4f} s at density {d['density']:g} "
            f"({_gb(d['bytes_total'])}, {d['bytes_ratio']:.4f} of dense; network "
            f"{d['network_s']:.4f} s with encode at {d['encode_gbps']:g} GB/s, verify "
            f"{d.get('verify_busy_s', d['verify_s']):.4f} s at {d['verify_gbps']:g} GB/s"
            + (f" and apply {d['apply_busy_s']:.4f} s" if d.get("apply_gbps") else "")
            + f" per bucket as it lands, {d['verify_s']:.4f} s of it after the last byte): "
            f"{d['speedup']:.1f}x dense "
            f"{d['dense_simulated_s']:.4f} s; shadow {_gb(d['shadow_bytes_max'])} per trainer"
        )
    return "\n".join(lines)
