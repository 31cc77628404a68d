"""`weightwire.bench.packrate` end to end on the CPU: Triton's interpreter, one small bucket,
every variant run and the FP8 ones checked bitwise (the timings are stubbed: the CPU
measures nothing). The GPU run is the suite's (`scripts/gpu-suite.sh`, stage colocated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightwire.client import fp8_kernel

SCRIPT = """
import sys
from weightwire.bench import packrate as pr
pr.DEVICE = "cpu"
pr._timed = lambda fn, reps: (fn(), {"ms": 1.0, "host_us": 1.0})[1]
pr.ROWS, pr.COLS = 256, 384
sys.exit(pr.main(["--bucket-mb", "1", "--json"]))
"""


@pytest.mark.skipif(fp8_kernel.triton is None, reason="needs Triton")
def test_packrate_runs_every_variant_bitwise() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout)
    what = [r["what"] for r in got["rows"]]
    assert what[0].startswith("baseline") and "bf16: copy kernel, one launch" in what
    fp8 = [r for r in got["rows"] if r["what"].startswith("fp8: ") and "bitwise" in r]
    exact = [n for n, v in fp8_kernel.VARIANTS.items() if not v.fast_div]
    assert len(fp8) == 2 + len(exact) and all(r["bitwise"] for r in fp8), fp8
    assert [r["launches"] for r in fp8] == [1] * len(fp8)
    assert [r["variant"] for r in fp8[2:]] == exact
