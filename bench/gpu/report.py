"""What `weightwire bench gpu` prints: per-version figures, medians, links against their
measured rates, stages, targets; the table, the JSON object, and the Chrome trace."""

from __future__ import annotations

import statistics
from typing import Any

SPEEDUP_TARGET = 3.0
LINK_TARGET = 0.8


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- per version
def version_summary(out: dict[str, Any]) -> None:
    """Adds the version's times and stages (wall clock, from the ranks' events)."""
    ww = out["ww"]
    start = min(ev["t0"] for ev in ww["trainers"] + ww["engines"])
    out["ww_s"] = max(ev["end"] for ev in ww["engines"]) - start
    out["ww_start"] = start
    tr = ww["trainers"]
    buckets = [b for ev in tr for b in ev["buckets"]]
    out["ww_bytes"] = sum(ev["nbytes"] for ev in tr)
    out["ww_stages"] = {
        # packing on the trainers: first bucket started .. last bucket's event complete
        "pack_s": max(
            (max(b[3] for b in ev["buckets"]) - min(b[2] for b in ev["buckets"]))
            for ev in tr
            if ev["buckets"]
        )
        if buckets
        else 0.0,
        "pack_sum_s": max(sum(b[3] - b[2] for b in ev["buckets"]) for ev in tr) if buckets else 0.0,
        "pack_host_s": max(ev["pack_seconds"] for ev in tr),
        "post_wait_ms_mean": 1e3 * statistics.fmean(b[4] - b[3] for b in buckets)
        if buckets
        else 0.0,
        "transfer_s": max(ev["transfer_seconds"] for ev in tr),  # first post .. last landed
        "total_s": out["ww_s"],
    }
    out["ww_verified"] = all(ev["ok"] for ev in out["ww_verify"])
    if "base" in out:
        b = out["base"]
        start = min(ev["t0"] for ev in b["trainers"] + b["engines"])
        out["base_s"] = max(ev["end"] for ev in b["engines"]) - start
        out["base_start"] = start
        out["base_stages"] = {
            "all_gather_s": max(ev["gather_s"] for ev in b["trainers"]),
            "broadcast_s": b["trainers"][0]["broadcast_s"],
            "receive_s": max(ev["receive_s"] for ev in b["engines"]),
            "copy_in_s": max(ev["copy_in_s"] for ev in b["engines"]),
            "total_s": out["base_s"],
        }
        out["base_verified"] = all(ev["ok"] for ev in out["base_verify"])


def version_line(out: dict[str, Any]) -> str:
    def ok(flag: bool) -> str:
        return "verified" if flag else "MISMATCH"

    line = f"v{out['version']}{' (warm-up)' if out['warmup'] else ''}: weightwire "
    line += f"{out['ww_s']:.3f} s ({ok(out['ww_verified'])})"
    if "base_s" in out:
        line += f", baseline {out['base_s']:.3f} s ({ok(out['base_verified'])})"
        line += f", {out['base_s'] / out['ww_s']:.2f}x"
    return line


# --------------------------------------------------------------------------- per run
def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    done = [v for v in rec.get("versions", []) if "ww_s" in v]
    measured = [v for v in done if not v["warmup"]] or done
    rec["measured_versions"] = [v["version"] for v in measured]
    rec["verified"] = {
        "weightwire": bool(done) and all(v["ww_verified"] for v in done),
        "baseline": (bool(done) and all(v.get("base_verified", False) for v in done))
        if rec.get("baseline")
        else None,
        "versions": len(done),
    }
    if not measured:
        return rec
    ww_s = _med([v["ww_s"] for v in measured])
    assert ww_s is not None
    nbytes = measured[-1]["ww_bytes"]
    rec["weightwire_s"] = ww_s
    rec["bytes"] = nbytes
    rec["weightwire_gbps"] = nbytes / ww_s / 1e9
    stages: dict[str, Any] = {
        "weightwire": {
            k: _med([v["ww_stages"][k] for v in measured]) for k in measured[0]["ww_stages"]
        }
    }
    if rec.get("baseline") and all("base_s" in v for v in measured):
        base_s = _med([v["base_s"] for v in measured])
        assert base_s is not None
        rec["baseline_s"] = base_s
        rec["speedup"] = base_s / ww_s
        model = rec["model"]["hf_bytes"]
        rec["baseline_bytes"] = {
            "all_gather_per_trainer": model * (rec["trainers"] - 1) // rec["trainers"],
            "broadcast_per_engine": model,
        }
        rec["baseline_gbps"] = nbytes / base_s / 1e9  # the same useful bytes, landed
        stages["baseline"] = {
            k: _med([v["base_stages"][k] for v in measured]) for k in measured[0]["base_stages"]
        }
    rec["stages"] = stages
    if rec["mode"] == "replica":
        _replica(rec, measured)
    else:
        _links(rec)
    rec["targets"] = _targets(rec)
    return rec


def _links(rec: dict[str, Any]) -> None:
    """Per link: the bytes the plan puts on it against its measured copy rate."""
    rates = rec["link_rates"]
    tg, eg = rec["gpus"]["trainers"], rec["gpus"]["engines"]
    dev = rec["gpus"].get("kind", "GPU")
    ww_s = rec["weightwire_s"]
    per_link: dict[tuple[int, int], dict[str, Any]] = {}
    for p in rec["trainer_plans"]:
        for e, b in p["by_engine"].items():
            key = (tg[p["rank"]], eg[int(e)])
            row = per_link.setdefault(
                key, {"link": f"{dev}{key[0]}->{dev}{key[1]}", "ranks": [], "bytes": 0}
            )
            row["ranks"].append(f"trainer {p['rank']} -> engine {e}")
            row["bytes"] += b
    rows = []
    for (a, b), row in sorted(per_link.items()):
        rows.append(_row(row, rates["pairs"].get(f"{a}->{b}"), ww_s))
    ports = []
    for g in sorted({k[0] for k in per_link}):
        total = sum(r["bytes"] for k, r in per_link.items() if k[0] == g)
        ports.append(
            _row({"link": f"{dev}{g} out", "bytes": total}, rates["out"].get(str(g)), ww_s)
        )
    for g in sorted({k[1] for k in per_link}):
        total = sum(r["bytes"] for k, r in per_link.items() if k[1] == g)
        ports.append(_row({"link": f"{dev}{g} in", "bytes": total}, rates["in"].get(str(g)), ww_s))
    rec["links"] = rows
    rec["ports"] = ports
    candidates = [r for r in rows + ports if r.get("floor_s") is not None]
    if candidates:
        busiest = max(candidates, key=lambda r: r["floor_s"])
        rec["busiest"] = busiest
        rec["link_fraction"] = busiest["floor_s"] / ww_s
    together = rates.get("all")
    if together:  # every link copying at once: the condition the transfer runs under
        both = [
            _row({"link": f"{dev}{g} {way}, all at once", "bytes": r["bytes"]}, rate, ww_s)
            for way, sel in (("out", 0), ("in", 1))
            for g, r in _port_bytes(per_link, sel).items()
            if (rate := together[way].get(str(g)))
        ]
        rec["concurrent"] = {"total_gbps": together["gbps"], "ports": both}
        if both:
            slowest = max(both, key=lambda r: r["floor_s"])
            rec["concurrent"]["busiest"] = slowest
            rec["concurrent"]["fraction"] = slowest["floor_s"] / ww_s


def _port_bytes(
    per_link: dict[tuple[int, int], dict[str, Any]], end: int
) -> dict[int, dict[str, Any]]:
    """Bytes leaving (end 0) or arriving at (end 1) each GPU."""
    out: dict[int, dict[str, Any]] = {}
    for key, row in per_link.items():
        out.setdefault(key[end], {"bytes": 0})["bytes"] += row["bytes"]
    return out


def _row(row: dict[str, Any], rate: float | None, seconds: float) -> dict[str, Any]:
    row = dict(row)
    row["rate_gbps"] = rate
    row["seconds"] = seconds
    row["gbps"] = row["bytes"] / seconds / 1e9
    if rate:
        row["floor_s"] = row["bytes"] / (rate * 1e9)
        row["fraction"] = row["gbps"] / rate
    return row


def _replica(rec: dict[str, Any], measured: list[dict[str, Any]]) -> None:
    """GPU -> pinned replica (packing), replica -> other daemon over tcp -> engine GPU
    (posted .. landed), and the whole sync."""
    pack_bytes = [sum(b[1] for b in v["ww"]["trainers"][0]["buckets"]) for v in measured]
    pack_s = [v["ww_stages"]["pack_sum_s"] for v in measured]
    tcp_s = [v["ww_stages"]["transfer_s"] for v in measured]
    nbytes = rec["bytes"]
    rates = rec["link_rates"]
    tg, eg = rec["gpus"]["trainers"][0], rec["gpus"]["engines"][0]
    p_s, t_s = _med(pack_s), _med(tcp_s)
    rec["replica_stages"] = {
        "gpu_to_replica": {
            "bytes": pack_bytes[-1],
            "seconds": p_s,
            "gbps": pack_bytes[-1] / p_s / 1e9 if p_s else None,
            "reference_d2h_gbps": rates.get("d2h", {}).get(str(tg)),
        },
        "replica_to_gpu_over_tcp": {
            "bytes": nbytes,
            "seconds": t_s,
            "gbps": nbytes / t_s / 1e9 if t_s else None,
            "reference_h2d_gbps": rates.get("h2d", {}).get(str(eg)),
        },
        "total": {
            "bytes": nbytes,
            "seconds": rec["weightwire_s"],
            "gbps": rec["weightwire_gbps"],
        },
    }


def _targets(rec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rec.get("speedup") is not None:
        out["speedup"] = {
            "target": SPEEDUP_TARGET,
            "value": rec["speedup"],
            "met": rec["speedup"] >= SPEEDUP_TARGET,
        }
    if rec.get("link_fraction") is not None:
        out["link_fraction"] = {
            "target": LINK_TARGET,
            "value": rec["link_fraction"],
            "met": rec["link_fraction"] >= LINK_TARGET,
            "of": rec["busiest"]["link"],
        }
    return out


# --------------------------------------------------------------------------- whole run
PRIMARY = (
    "weightwire_s",
    "baseline_s",
    "speedup",
    "bytes",
    "weightwire_gbps",
    "baseline_gbps",
    "links",
    "ports",
    "busiest",
    "link_fraction",
    "concurrent",
    "stages",
    "replica_stages",
    "verified",
    "targets",
)


def finish(result: dict[str, Any]) -> None:
    runs = result["runs"]
    ok = bool(runs)
    for r in runs:
        v = r.get("verified") or {}
        if r.get("error") or not v.get("weightwire") or v.get("baseline") is False:
            ok = False
    result["ok"] = ok
    primary = next((r for r in runs if "weightwire_s" in r), None)
    if primary is not None:
        result["primary"] = primary["pair"]
        for k in PRIMARY:
            if k in primary:
                result[k] = primary[k]


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
        c = r.get("concurrent") or {}
        if c.get("busiest"):
            b = c["busiest"]
            out.append(
                f"    every link copying at once (plain peer copies, same run): "
                f"{c['total_gbps']:.1f} GB/s in total; {b['link']} at "
                f"{b['rate_gbps']:.1f} GB/s must carry {_gb(b['bytes'])} GB, "
                f"{b['floor_s']:.4f} s = {c['fraction']:.2f} of that rate"
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
                f"{p['packs']} packs, staging {_gb(p['staging_bytes'])} GB ({p['staging']})"
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


# --------------------------------------------------------------------------- trace
STAGES = (
    "weightwire",
    "baseline",
    "ww prepare",
    "ww post wait",
    "ww transfer",
    "ww landed",
    "base all_gather",
    "base broadcast",
    "base receive",
    "base copy-in",
)


def trace(result: dict[str, Any]) -> dict[str, Any]:
    """Chrome/Perfetto trace: one process per rank (per run), one track per stage; each
    bucket's prepare, post wait and transfer spans for every version, and the baseline's
    per-bucket stages. Overlapping spans of one stage go to extra tracks ("#1", ...)."""
    spans: list[tuple[int, str, str, float, float, dict[str, Any]]] = []
    names: dict[int, str] = {}
    for ri, r in enumerate(result["runs"]):
        base_pid = 1000 * (ri + 1)
        T = r.get("trainers", 0)
        g = r.get("gpus", {"trainers": [], "engines": []})
        dev = g.get("kind", "GPU")
        sync_pid = base_pid
        names[sync_pid] = f"{r['pair']}: syncs"
        for t in range(T):
            gpu = g["trainers"][t] if g["trainers"] else "-"
            names[base_pid + 1 + t] = f"{r['pair']}: trainer {t} ({dev} {gpu})"
        for e in range(r.get("engines", 0)):
            gpu = g["engines"][e] if g["engines"] else "-"
            names[base_pid + 1 + T + e] = f"{r['pair']}: engine {e} ({dev} {gpu})"
        for v in r.get("versions", []):
            ver = v["version"]
            if "ww_s" in v:
                spans.append(
                    (
                        sync_pid,
                        "weightwire",
                        f"weightwire v{ver}",
                        v["ww_start"],
                        v["ww_start"] + v["ww_s"],
                        {"seconds": v["ww_s"]},
                    )
                )
                for t, ev in enumerate(v["ww"]["trainers"]):
                    pid = base_pid + 1 + t
                    for idx, nb, ps, pr, po, la in ev["buckets"]:
                        a = {"version": ver, "bucket": idx, "bytes": nb}
                        spans.append((pid, "ww prepare", f"prepare b{idx}", ps, pr, a))
                        spans.append((pid, "ww post wait", f"post b{idx}", pr, po, a))
                        spans.append((pid, "ww transfer", f"transfer b{idx}", po, la, a))
                for e, ev in enumerate(v["ww"]["engines"]):
                    spans.append(
                        (
                            base_pid + 1 + T + e,
                            "ww landed",
                            f"v{ver} landed",
                            ev["t0"],
                            ev["end"],
                            {"version": ver},
                        )
                    )
            if "base_s" in v:
                spans.append(
                    (
                        sync_pid,
                        "baseline",
                        f"baseline v{ver}",
                        v["base_start"],
                        v["base_start"] + v["base_s"],
                        {"seconds": v["base_s"]},
                    )
                )
                for t, ev in enumerate(v["base"]["trainers"]):
                    for i, (m0, m1, m2) in enumerate(ev["spans"]):
                        a = {"version": ver, "bucket": i}
                        spans.append(
                            (base_pid + 1 + t, "base all_gather", f"gather b{i}", m0, m1, a)
                        )
                        if t == 0:
                            spans.append(
                                (base_pid + 1, "base broadcast", f"broadcast b{i}", m1, m2, a)
                            )
                for e, ev in enumerate(v["base"]["engines"]):
                    pid = base_pid + 1 + T + e
                    for i, (m0, m1, m2) in enumerate(ev["spans"]):
                        a = {"version": ver, "bucket": i}
                        spans.append((pid, "base receive", f"receive b{i}", m0, m1, a))
                        spans.append((pid, "base copy-in", f"copy-in b{i}", m1, m2, a))
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s[3] for s in spans if s[3] > 0)
    events: list[dict[str, Any]] = []
    lanes: dict[tuple[int, str], list[float]] = {}  # per stage track: end of its last span
    tids: dict[tuple[int, str, int], int] = {}
    order = {k: i for i, k in enumerate(STAGES)}
    for pid, stage, name, t0, t1, a in sorted(
        spans, key=lambda s: (s[0], order.get(s[1], len(order)), s[3])
    ):
        if t0 <= 0 or t1 <= 0:
            continue  # a stamp the rank never got (e.g. a bucket with no writes)
        ends = lanes.setdefault((pid, stage), [])
        lane = next((i for i, end in enumerate(ends) if end <= t0), len(ends))
        if lane == len(ends):
            ends.append(t1)
        else:
            ends[lane] = t1
        key = (pid, stage, lane)
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == pid]) + 1
            label = stage if lane == 0 else f"{stage} #{lane}"
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": tids[key],
                    "args": {"name": label},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tids[key],
                    "args": {"sort_index": tids[key]},
                }
            )
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": stage,
                "pid": pid,
                "tid": tids[key],
                "ts": (t0 - origin) * 1e6,
                "dur": max(0.0, (t1 - t0) * 1e6),
                "args": a,
            }
        )
    for pid, name in names.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
