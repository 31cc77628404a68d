"""`weightwire demo`, the README's first command, end to end (small model, namespaces if root)."""

from __future__ import annotations

import re
import subprocess
import sys

from .conftest import NETNS


def demo(model_gb: float, versions: int, *more: str, timeout_s: float) -> str:
    """`weightwire demo` in a process of its own (in namespaces when root): its output,
    once it has exited 0."""
    cmd = [sys.executable, "-m", "weightwire.cli.main", "demo", "--model-gb", str(model_gb),
           "--versions", str(versions), *more, "--netns", "on" if NETNS else "off"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    return out.stdout


def test_demo_verifies_every_byte_and_stops_cleanly() -> None:
    stdout = demo(0.15, 3, timeout_s=300)
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("verified 3 versions") and "bitwise equal" in last, stdout
    assert "stopped cleanly" in last
    table = [line for line in stdout.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+\s", line)]
    assert len(table) == 3 and all("ok (2/2 engine ranks)" in row for row in table), stdout
    # version, sync s, GB moved, of dense, kind, density: dense first, then sparse deltas
    rows = [row.split() for row in table]
    assert rows[0][4] == "dense" and float(rows[0][3]) == 1.0, stdout
    for row in rows[1:]:
        assert row[4] == "delta" and float(row[3]) < 0.1, stdout
