"""Device info and link rates, measured by `weightwire.bench.gpu.links` in a process of
its own."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from .errors import RunError
from .processes import child_env


def probe(
    device: str, pairs: list[tuple[int, int]], mb: int, reps: int, host: bool
) -> dict[str, Any]:
    """Device info and link rates, from a process of its own (it holds GPU memory)."""
    cmd = [sys.executable, "-m", "weightwire.bench.gpu.links", "--device", device]
    if pairs:
        cmd += ["--pairs", ",".join(f"{a}:{b}" for a, b in pairs), "--mb", str(mb)]
        cmd += ["--reps", str(reps)]
        if host:
            cmd.append("--host")
    else:
        cmd.append("--info-only")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(device))
    if out.returncode != 0:
        raise RunError(f"link measurement failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
