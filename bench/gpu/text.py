"""The table `weightwire bench gpu` prints, from the figures `report` computes."""

from __future__ import annotations

from typing import Any


def version_line(out: dict[str, Any]) -> str:
    def ok(flag: bool) -> str:
        return "verified" if flag else "MISMATCH"

    line = f"v{out['version']}{' (warm-up)' if out['warmup'] else ''}: weightwire "
    line += f"{out['ww_s']:.3f} s ({ok(out['ww_verified'])})"
    if "base_s" in out:
        line += f", baseline {out['base_s']:.3f} s ({ok(out['base_verified'])})"
        line += f", {out['base_s'] / out['ww_s']:.2f}x"
    return line


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"weightwire bench gpu: {m['architecture']} ({m['config']}), random BF16 weights -> "
        f"{'FP8 block' if result['dest'] == 'fp8' else 'BF16'} engines",
        "device: "
        + (
            ", ".join(f"GPU{i} {n}" for i, n in enumerate(result["gpus"]))
            if result["gpus"]
            else "CPU (gloo + tcp: exercises the program, measures nothing about GPUs)"
        )
        + f"; torch {result['torch']}, CUDA {result['cuda']}, NCCL {result.get('nccl')}",
    ]
    for r in result["runs"]:
        lines.append("")
        lines += _render_run(r, result)
    for c in result.get("staging_rings", []):
        lines.append(
            f"staging {c['pair']}: {c['ratio']:.3f} of {c['against']}'s throughput "
            f"({c['seconds']:.4f} s vs {c['against_seconds']:.4f} s), staging "
            f"{_gb(c['staging_bytes'])} GB vs {_gb(c['against_staging_bytes'])} GB per trainer"
        )
    lines.append("")
    lines.append("ALL VERIFIED" if result["ok"] else "FAILED (see above)")
    return "\n".join(lines)


def _render_run(r: dict[str, Any], result: dict[str, Any]) -> list[str]:
    T, E = r.get("trainers", "?"), r.get("engines", "?")
    g = r.get("gpus", {})
    held = "full tensors" if result["trainer_layout"] == "full" else f"FSDP-{T}"
    tgpus = ",".join(map(str, g.get("trainers", [])))
    egpus = ",".join(map(str, g.get("engines", [])))
    dev = g.get("kind", "GPU")
    head = (
        f"{r['pair']}: {T} trainer rank(s) ({held}, {dev} {tgpus}) -> {E} engine rank(s) "
        f"(TP-{E}, {dev} {egpus})"
    )
    out = [head]
    if "model" in r:
        mm = r["model"]
        out.append(
            f"  model: {mm['layers']} layers ({r.get('layers_why', '')}), {mm['hf_tensors']} HF "
            f"tensors, {_gb(mm['hf_bytes'])} GB; engines hold {_gb(sum(mm['engine_bytes']))} GB"
        )
    if r.get("baseline_skipped"):
        out.append(f"  baseline skipped: {r['baseline_skipped']}")
    if r.get("error"):
        out.append(f"  ERROR: {r['error']}")
    if r.get("cut"):
        out.append(f"  {r['cut']}")
    if "weightwire_s" not in r:
        return out
    v = r["verified"]
    n = len(r["measured_versions"])
    out.append(f"  medians of {n} version(s) after a warm-up; every engine tensor compared bitwise")
    out.append(f"    {'method':<12} {'time s':>8} {'GB/s':>8}  verified")
    out.append(
        f"    {'weightwire':<12} {r['weightwire_s']:>8.3f} {r['weightwire_gbps']:>8.1f}  "
        f"{'ok' if v['weightwire'] else 'MISMATCH'} ({v['versions']} versions)"
    )
    if "baseline_s" in r:
        out.append(
            f"    {'baseline':<12} {r['baseline_s']:>8.3f} {r['baseline_gbps']:>8.1f}  "
            f"{'ok' if v['baseline'] else 'MISMATCH'} ({v['versions']} versions)"
        )
        t = r["targets"]["speedup"]
        out.append(
            f"    speedup {r['speedup']:.2f}x over the broadcast baseline "
            f"(target >= {t['target']:.0f}x: {'met' if t['met'] else 'NOT met'})"
        )
    out.append(f"    GB/s counts the {_gb(r['bytes'])} GB the engines need (the plan's writes)")
    if r["mode"] == "replica":
        rs = r["replica_stages"]
        out.append("  stages of the CPU replica path:")
        for k, label in (
            ("gpu_to_replica", "GPU -> pinned replica (pack)"),
            ("replica_to_gpu_over_tcp", "replica -> tcp -> engine GPU"),
            ("total", "total (stages overlap)"),
        ):
            s = rs[k]
            ref = s.get("reference_d2h_gbps") or s.get("reference_h2d_gbps")
            ref_s = f"  (pinned copy rate measured: {ref:.1f} GB/s)" if ref else ""
            out.append(
                f"    {label:<32} {_gb(s['bytes'])} GB in {s['seconds']:.3f} s = "
                f"{s['gbps']:.2f} GB/s{ref_s}"
            )
    if r.get("links"):
        out.append(
            f"    {'link':<14} {'GB':>8} {'rate GB/s':>10} {'floor s':>8} "
            f"{'got GB/s':>9} {'of rate':>8}"
        )
        for row in r["links"] + r["ports"]:
            rate = _num(row.get("rate_gbps"), ".1f")
            floor = _num(row.get("floor_s"), ".4f")
            frac = _num(row.get("fraction"), ".2f")
            out.append(
                f"    {row['link']:<14} {_gb(row['bytes']):>8} {rate:>10} {floor:>8} "
                f"{row['gbps']:>9.1f} {frac:>8}"
            )
        if "busiest" in r:
            b = r["busiest"]
            t = r["targets"]["link_fraction"]
            out.append(
                f"    busiest: {b['link']} must carry {_gb(b['bytes'])} GB, "
                f"{b['floor_s']:.4f} s at "
                f"its {b['rate_gbps']:.1f} GB/s; weightwire took {r['weightwire_s']:.4f} s = "
                f"{r['link_fraction']:.2f} of the rate (target >= {t['target']}: "
                f"{'met' if t['met'] else 'NOT met'})"
            )
    st = r["stages"]
    w = st["weightwire"]
    out.append(
        f"  stages, weightwire: pack {w['pack_s']:.3f} s (host {w['pack_host_s']:.3f} s), "
        f"post wait {w['post_wait_ms_mean']:.2f} ms/bucket, posted->landed "
        f"{w['transfer_s']:.3f} s, total {w['total_s']:.3f} s"
    )
    if "baseline" in st:
        b = st["baseline"]
        out.append(
            f"  stages, baseline:   all_gather {b['all_gather_s']:.3f} s, broadcast "
            f"{b['broadcast_s']:.3f} s, copy-in {b['copy_in_s']:.3f} s, total {b['total_s']:.3f} s"
        )
    tp = r.get("trainer_plans") or []
    if tp:
        out.append(
            "  plan: "
            + "; ".join(
                f"trainer {p['rank']} {p['writes']} writes, {p['buckets']} buckets, "
                f"{p['packs']} packs, staging {_gb(p['staging_bytes'])} GB ({p['staging']}, "
                + (f"ring of {p['staging_buckets']}" if p.get("staging_buckets") else "whole send")
                + ")"
                for p in tp
            )
        )
    if r.get("transports"):
        moved = ", ".join(
            f"{node}: "
            + ", ".join(f"{t} {_gb(s.get('bytes_sent', 0))} GB sent" for t, s in ts.items())
            for node, ts in r["transports"].items()
        )
        out.append(f"  transports (all versions): {moved}")
    return out
