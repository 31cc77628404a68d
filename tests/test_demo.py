"""`weightwire demo`, the README's first command, end to end (small model, namespaces if root)."""

from __future__ import annotations

import re
import subprocess
import sys

from .conftest import NETNS


def test_demo_verifies_every_byte_and_stops_cleanly() -> None:
    cmd = [
        sys.executable,
        "-m",
        "weightwire.cli.main",
        "demo",
        "--model-gb",
        "0.15",
        "--versions",
        "3",
        "--netns",
        "on" if NETNS else "off",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("verified 3 versions") and "bitwise equal" in last, out.stdout
    assert "stopped cleanly" in last
    table = [line for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+\s", line)]
    assert len(table) == 3 and all("ok (2/2 engine ranks)" in row for row in table), out.stdout
    # version, sync s, GB moved, of dense, kind, density: dense first, then sparse deltas
    rows = [row.split() for row in table]
    assert rows[0][4] == "dense" and float(rows[0][3]) == 1.0, out.stdout
    for row in rows[1:]:
        assert row[4] == "delta" and float(row[3]) < 0.1, out.stdout
