"""A replan stops the planning it supersedes, in its thread.

A replan cancelled the coordinator's planning task, but a thread already in the planner ran
on to the end, its plan thrown away: each replan of a burst (replicas joining one after
another, ranks coming and going) left one more thread working on the executor, beside the
planning that counts. Now each planning run holds a stop flag that the planner checks at
every phase (`daemon/planrun.py`); a superseded run stops there, with one log line, and
the coordinator's status shows the phase a job's planning is in. Here replica 0's only
rank leaves while a thread plans that replica (30000 tensors): that thread stops at the
planner's next phase; a rank that comes after is planned and gets a version bitwise.
Real daemons in network namespaces; the coordinator's CPU time is printed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import WeightwireError, retryable

from .conftest import FAST, NETNS, NETNS_WHY, serve

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
TENSORS = int(os.environ.get("WEIGHTWIRE_TEST_REPLAN_TENSORS", "30000"))


@pytest.fixture(scope="module")
def two() -> Iterator[LocalCluster]:
    """host0 coordinates and trains; host1 serves both replicas. Adverts of 20000 tensors
    take more than FAST's 4 MiB."""
    yield from serve(
        LocalCluster(hosts=2, use_netns=True, extra={**FAST, "max-message-bytes": str(64 << 20)})
    )


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_replan_stops_the_planning_thread_it_supersedes(two: LocalCluster) -> None:
    c = two
    job = "replan-supersedes"
    ws = {f"w{i}": torch.arange(16, dtype=torch.float32) + i for i in range(TENSORS)}
    dst = {k: torch.zeros_like(v) for k, v in ws.items()}
    coord, sock = c.daemons[0].socket, c.daemons[1].socket
    pid = int(fetch(coord)["pid"])

    def engine() -> Engine:
        return Engine(0, 1, socket=sock, job=job, timeout_s=60, replica=0, replica_size=1)

    with Trainer(0, 1, socket=coord, job=job, timeout_s=60) as tr:
        tr.register(ws)
        cpu0 = cpu_s(pid)
        with engine() as gone:
            gone.register({k: torch.zeros_like(v) for k, v in ws.items()})
            deadline = time.monotonic() + 30
            while True:  # until a thread is in the planner, planning replica 0
                phase = fetch(coord)["coordination"]["jobs"].get(job, {}).get("planning")
                if phase not in (None, "preparing", "queued"):
                    break
                assert time.monotonic() < deadline, "replica 0 was never planned"
                time.sleep(0.005)
        # its rank has left (a small advert): a replan, while replica 0's planning runs
        with engine() as eng:
            eng.register(dst)
            version = 0
            while True:  # replica 0 planned again, for the rank now there
                assert time.monotonic() < deadline + 60, "replica 0 was never planned again"
                version += 1
                try:
                    stats = tr.publish(version)
                except WeightwireError as exc:
                    assert retryable(exc), exc
                    continue
                if [o.replica for o in stats.replicas if o.ok] == [0]:
                    break
            eng.wait(version)
            assert all(torch.equal(dst[k], ws[k]) for k in ws)
        cpu1 = cpu_s(pid)
    logs = c.daemons[0].logs()
    stopped = [e for e in logs if e.get("event") == "planning superseded" and e["job"] == job]
    planned = [e for e in logs if e.get("event") == "engine replica planned" and e["job"] == job]
    print(
        f"\n{TENSORS} tensors: planning superseded {[(e['after'], e['seconds']) for e in stopped]}"
        f", replica plans made {[(e['replica'], e['seconds']) for e in planned]}; coordinator "
        f"CPU {cpu1 - cpu0:.2f} s"
    )
    assert stopped, "the superseded planning ran on in its thread"
    assert all(e["after"] != "done" for e in stopped), stopped
