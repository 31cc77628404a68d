"""The Chrome/Perfetto trace of a `weightwire bench gpu` run (`--trace`)."""

from __future__ import annotations

from typing import Any

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


Span = tuple[int, str, str, float, float, dict[str, Any]]  # pid, stage, name, t0, t1, args


def _whole(pid: int, method: str, version: int, start: float, seconds: float) -> Span:
    """One method's whole version, on the run's syncs track."""
    return (pid, method, f"{method} v{version}", start, start + seconds, {"seconds": seconds})


def trace(result: dict[str, Any]) -> dict[str, Any]:
    """Chrome/Perfetto trace: one process per rank (per run), one track per stage; each
    bucket's prepare, post wait and transfer spans for every version, and the baseline's
    per-bucket stages. Overlapping spans of one stage go to extra tracks ("#1", ...)."""
    spans: list[Span] = []
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
                spans.append(_whole(sync_pid, "weightwire", ver, v["ww_start"], v["ww_s"]))
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
                spans.append(_whole(sync_pid, "baseline", ver, v["base_start"], v["base_s"]))
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
