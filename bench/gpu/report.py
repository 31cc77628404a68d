"""The figures of `weightwire bench gpu`: per-version times and stages, per-run medians,
links against their measured rates, replica stages, targets, and the whole run's JSON
object. `text` formats them as the table, `chrome_trace` as a Chrome trace."""

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
    "stages",
    "replica_stages",
    "verified",
    "targets",
)


def _rings(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of one pair with different staging rings (`--staging-buckets 0,2,4`): each
    against the pair's first, as a throughput ratio (its median time over theirs)."""
    out: list[dict[str, Any]] = []
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for r in runs:
        if "weightwire_s" not in r or "staging_buckets" not in r:
            continue
        key = (r["trainers"], r["engines"])
        base = first.setdefault(key, r)
        if base is r:
            continue

        def held(run: dict[str, Any]) -> int:
            return max((p["staging_bytes"] for p in run.get("trainer_plans", [])), default=0)

        out.append(
            {
                "pair": r["pair"],
                "against": base["pair"],
                "ratio": base["weightwire_s"] / r["weightwire_s"],
                "seconds": r["weightwire_s"],
                "against_seconds": base["weightwire_s"],
                "staging_bytes": held(r),
                "against_staging_bytes": held(base),
            }
        )
    return out


def finish(result: dict[str, Any]) -> None:
    runs = result["runs"]
    ok = bool(runs)
    for r in runs:
        v = r.get("verified") or {}
        if r.get("error") or not v.get("weightwire") or v.get("baseline") is False:
            ok = False
    result["ok"] = ok
    result["staging_rings"] = _rings(runs)
    primary = next((r for r in runs if "weightwire_s" in r), None)
    if primary is not None:
        result["primary"] = primary["pair"]
        for k in PRIMARY:
            if k in primary:
                result[k] = primary[k]
