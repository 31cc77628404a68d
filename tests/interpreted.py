"""Tests of a Triton kernel on CPU, through Triton's interpreter. Triton picks the
interpreter when it is imported, so a test file's CPU tests run in a pytest of its own with
TRITON_INTERPRET=1 in its environment; the file marks them `INTERP`, its GPU tests `CUDA`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from weightwire.client import fp8_kernel

NEEDS_TRITON = pytest.mark.skipif(fp8_kernel.triton is None, reason="needs Triton")
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_kernel.INTERPRETED, reason="needs CUDA (compiled)"
)
INTERP = pytest.mark.skipif(
    not fp8_kernel.INTERPRETED, reason="runs in the pytest that TRITON_INTERPRET=1 starts"
)
OUTSIDE = pytest.mark.skipif(fp8_kernel.INTERPRETED, reason="this is that pytest")


def run_interpreted(path: str, flag: str, passed: str, timeout_s: float) -> None:
    """Runs the test file at `path` (its CPU tests) in a pytest under the interpreter, with
    `flag`=1 set (the kernel's switch); its summary must read `passed` passed (a regular
    expression) and 1 skipped (the test that called this)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", flag: "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu",
         path],
        env=env, capture_output=True, text=True, timeout=timeout_s,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{passed} passed, 1 skipped", last), last
