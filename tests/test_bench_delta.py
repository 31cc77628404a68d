"""`weightwire bench delta --json` on a small model: every field of issue 17's item 6, a run
per learning rate on veth shaped by tc (10 Gbit/s by default) and the unshaped veth run
beside it; every version verified. Speed is never asserted (only that each ratio is the
ratio of its own figures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import NETNS, NETNS_WHY

SMALL = ["--layers", "2", "--width", "1024", "--steps", "1", "--lr", "1e-6"]


def bench(*flags: str) -> dict:
    cmd = [sys.executable, "-m", "weightwire.cli.main", "bench", "delta", "--json", *SMALL, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not NETNS, reason=f"--link-gbps shapes veth in namespaces: {NETNS_WHY}")
@pytest.mark.parametrize(
    ("flags", "links"),
    [((), [10.0]), (("--link-gbps", "1"), [1.0]), (("--unshaped-only",), [])],
)
def test_bench_delta_reports_unshaped_and_shaped_runs(
    flags: tuple[str, ...], links: list[float]
) -> None:
    report = bench(*flags)
    assert report["verified"] is True and report["link_gbps"] == links
    runs, unshaped = report["runs"], report["unshaped_runs"]
    assert [r["link_gbps"] for r in runs] == (links or [None])  # one per learning rate
    assert [r["link_gbps"] for r in unshaped] == ([None] if links else [])
    for r in runs + unshaped:
        assert r["verified"] is True
        assert 0 < r["density"] < 1
        assert r["delta_bytes"] < r["dense_bytes"]
        assert r["bytes_ratio"] == pytest.approx(r["delta_bytes"] / r["dense_bytes"], abs=1e-5)
        # the times are rounded to 0.1 ms (5e-5 each way), the speedup from the exact ones
        d, n = r["delta_s"], r["dense_s"]
        slack = 5e-4 + 5e-5 * (1 / d + n / d**2)
        assert r["speedup"] == pytest.approx(n / d, abs=slack)
        assert len(r["delta_s_each"]) == len(r["dense_s_each"]) == r["steps"]
        for kind in ("delta", "dense"):  # where each publish's time went, in its order
            t = r["timeline_s"][kind]
            assert 0 <= t["begin"] <= t["last_posted"] <= t["last_landed"] <= t["total"], t
            assert t["after_landed"] == pytest.approx(t["total"] - t["last_landed"], abs=2e-4)
