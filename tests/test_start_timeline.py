"""Where a version's start-up goes: the daemon's first events of each version, in the
trainer's `PublishStats.timeline` and in the daemon's one line per version (`start_ms`), and
the BeginVersion round trip on its own (`begin_request_seconds`). A real daemon, a trainer
and an engine rank of this process on host memory (tcp from the daemon to itself)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST

BUCKET = 64 << 10


@pytest.fixture(scope="module")
def daemon() -> Iterator[LocalCluster]:
    small = {"bucket-bytes": str(BUCKET), "max-write-bytes": str(BUCKET)}
    c = LocalCluster(hosts=1, insecure=True, extra={**FAST, **small})
    c.start()
    yield c
    assert c.stop() == [0], f"logs in {c.workdir}"


def _version_lines(c: LocalCluster, job: str, version: int) -> list[dict[str, object]]:
    return [
        e
        for e in c.daemons[0].logs()
        if e.get("event") == "version" and e.get("job") == job and e.get("version") == version
    ]


@pytest.mark.parametrize("slots", [0, 2])
def test_each_version_reports_its_first_events_in_order(daemon: LocalCluster, slots: int) -> None:
    job = f"timeline-{slots}"
    rows, cols = 64, 1024  # 256 KiB of float32: 4 buckets
    dst = torch.zeros(rows, cols)
    eng = Engine(0, 1, socket=daemon.daemons[0].socket, job=job, timeout_s=60)
    eng.register({"w": dst})
    w = torch.zeros(rows, cols)
    sock = daemon.daemons[0].socket
    with Trainer(0, 1, socket=sock, job=job, timeout_s=60, staging_buckets=slots) as tr:
        tr.register({"w": w})
        plan = tr.prepare()
        assert len(plan.buckets) == 4
        for version in (1, 2):
            w.copy_(torch.randn(rows, cols))
            stats = tr.publish(version)
            eng.wait(version)
            assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8)), version
            assert 0 < stats.begin_request_seconds <= stats.begin_seconds, stats
            t = stats.timeline
            # tcp keeps no copy stamps: the events every transport has, in order
            assert set(t) == {"first_ready", "first_routed", "first_landed"}, t
            assert 0 <= t["first_ready"] <= t["first_routed"] <= t["first_landed"], t
            assert t["first_landed"] <= stats.seconds, (t, stats.seconds)
            deadline = time.monotonic() + 10
            while not (lines := _version_lines(daemon, job, version)):
                assert time.monotonic() < deadline, "no version line"
                time.sleep(0.05)
            (line,) = lines
            start = line["start_ms"]
            assert isinstance(start, dict) and set(start) == {"0"}, line
            assert start["0"] == {k: round(v * 1e3, 3) for k, v in t.items()}, (start, t)
    eng.close()
