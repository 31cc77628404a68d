"""The SGLang plugin's engine side may start before its host's weightwired: it waits for the
daemon's socket (bounded, logged) instead of failing the engine's start-up."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from weightwire.adapters.sglang.daemonstart import open_engine, wait_for_daemon
from weightwire.adapters.sglang.settings import Settings
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError

from .conftest import FAST


def test_engine_started_before_the_daemon_waits_then_registers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = LocalCluster(hosts=1, insecure=True, extra=FAST)
    socket = str(c.workdir / "host0.sock")  # where host0's daemon will serve
    settings = Settings(mode="rules", socket=socket, job="late", daemon_wait_s=60, timeout_s=30)
    got: dict[str, Any] = {}

    def engine_side() -> None:
        try:
            got["engine"] = open_engine(settings, 0, 1, None)
        except BaseException as exc:
            got["error"] = exc

    caplog.set_level(logging.INFO, logger="weightwire.adapters.sglang.plugin")
    t = threading.Thread(target=engine_side)
    t.start()
    try:
        time.sleep(1.5)
        assert t.is_alive() and not got, f"the engine side did not wait: {got}"
        assert any("waiting for weightwired's socket" in r.message for r in caplog.records)
        c.start()  # the daemon comes up after the engine
        t.join(30)
        assert not t.is_alive() and "error" not in got, got
        engine = got["engine"]
        weights = {"w": torch.zeros(16, 8)}
        engine.register(weights)
        held = fetch(socket)
        assert "engine" in [s["role"] for s in held["sessions"]]
        assert held["regions"] and held["regions"][0]["bytes"] >= weights["w"].nbytes
        assert any("appeared after" in r.message for r in caplog.records)
        engine.close()
    finally:
        t.join(5)
        assert c.stop() == [0]


def test_the_wait_is_bounded_and_says_what_to_set(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(WeightwireError) as err:
        wait_for_daemon(str(tmp_path / "nobody.sock"), 0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert err.value.code == ErrorCode.PEER_LOST
    msg = str(err.value)
    assert str(tmp_path / "nobody.sock") in msg and "WEIGHTWIRE_SOCKET" in msg
    assert "WEIGHTWIRE_DAEMON_WAIT_S" in msg


def test_settings_read_the_wait_from_the_environment() -> None:
    s = Settings.from_env({"WEIGHTWIRE_SGLANG": "rules", "WEIGHTWIRE_DAEMON_WAIT_S": "7.5"})
    assert s.daemon_wait_s == 7.5
    assert Settings.from_env({"WEIGHTWIRE_SGLANG": "rules"}).daemon_wait_s == 300.0
