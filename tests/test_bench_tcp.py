"""`weightwire bench tcp --json` reports both figures from one run, for each tcp security
setting; it never asserts speed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from .conftest import NETNS, NETNS_WHY


@pytest.mark.skipif(not NETNS, reason=f"needs network namespaces: {NETNS_WHY}")
@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 is not installed")
def test_bench_tcp_reports_weightwire_beside_iperf3() -> None:
    cmd = [
        sys.executable,
        "-m",
        "weightwire.cli.main",
        "bench",
        "tcp",
        "--json",
        "--gb",
        "0.2",
        "--rounds",
        "1",
        "--seconds",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True
    assert report["weightwire_gbps"] > 0 and report["iperf3_gbps"] > 0
    assert report["ratio"] == pytest.approx(
        report["weightwire_gbps"] / report["iperf3_gbps"], rel=0.01
    )
    assert set(report["modes"]) == {"off", "auth", "encrypt"}  # plain, authenticated, encrypted
    for mode in report["modes"].values():
        assert mode["verified"] is True and mode["iperf3_gbps"] > 0
        assert mode["ratio"] == pytest.approx(
            mode["weightwire_gbps"] / mode["iperf3_gbps"], rel=0.01
        )
