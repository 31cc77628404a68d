"""A rank pointed at a path where no daemon socket is: a typed error naming the path and
what to set, and not retryable (the same path fails the same way until something changes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weightwire.client.connection import DaemonConnection
from weightwire.protocol.errors import ErrorCode, NoDaemonError, WeightwireError, retryable


def test_missing_socket_is_a_typed_error_that_is_not_retried(tmp_path: Path) -> None:
    path = tmp_path / "nobody.sock"
    with pytest.raises(NoDaemonError) as err:
        DaemonConnection(str(path))
    assert isinstance(err.value, WeightwireError)
    assert err.value.code is ErrorCode.INVALID and not retryable(err.value)
    msg = str(err.value)
    assert f"no daemon socket at {path}" in msg
    assert "weightwired running" in msg and "WEIGHTWIRE_SOCKET" in msg


def test_status_names_the_missing_socket(tmp_path: Path) -> None:
    path = tmp_path / "nobody.sock"
    r = subprocess.run(
        [sys.executable, "-m", "weightwire.cli", "status", "--socket", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert f"no daemon socket at {path}" in r.stdout + r.stderr
