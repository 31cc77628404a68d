"""A node whose link goes down is dropped; when the link returns it is back within 3 s, however
long the outage (TCP alone retransmits with exponential backoff: 13.7 s after a 15 s outage).
Real daemons in network namespaces; the link is the host's veth, set down inside its namespace."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, NETNS_WHY, serve

pytestmark = pytest.mark.skipif(not NETNS, reason=f"rejoin tests need namespaces: {NETNS_WHY}")
REJOIN_S = 3.0


@pytest.fixture(scope="module")
def two() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=True, extra=FAST))


def link(c: LocalCluster, host: int, state: str) -> None:
    assert c.net is not None
    subprocess.run(["ip", "-n", c.net.names[host], "link", "set", "eth0", state], check=True)


def joined(c: LocalCluster) -> bool:
    """host1 is a member at the coordinator, and host1 has the coordinator."""
    members = (fetch(c.daemons[0].socket).get("coordination") or {}).get("members", [])
    return "host1" in members and fetch(c.daemons[1].socket)["coordinator"] == "host0"


def until(cond, timeout_s: float) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until `cond()` held (polled every 50 ms), None if it did not in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@pytest.mark.parametrize(
    "outage_s", [5, 15, pytest.param(60, marks=pytest.mark.slow)], ids=["5s", "15s", "60s"]
)
def test_rejoin_within_3s_of_the_link_returning(two: LocalCluster, outage_s: int) -> None:
    assert joined(two)
    link(two, 1, "down")
    try:
        dropped = until(lambda: not joined(two), 10.0)
        assert dropped is not None, "host1 was never dropped while its link was down"
        time.sleep(max(0.0, outage_s - dropped))
    finally:
        link(two, 1, "up")
    rejoined = until(lambda: joined(two), 30.0)
    print(f"outage {outage_s} s: rejoined {rejoined} s after the link came back")
    assert rejoined is not None and rejoined <= REJOIN_S, f"rejoined after {rejoined} s"
    # and the data plane serves again: a version from host1 to host0, bitwise
    job = f"after-{outage_s}s"
    dst = torch.zeros(256, 1024)
    with (
        Engine(0, 1, socket=two.daemons[0].socket, job=job, timeout_s=30) as eng,
        Trainer(0, 1, socket=two.daemons[1].socket, job=job, timeout_s=30) as tr,
    ):
        eng.register({"w": dst})
        src = torch.randn(256, 1024)
        tr.register({"w": src})
        tr.prepare()
        tr.publish(1, {"w": src})
        eng.wait(1, timeout_s=30)
        assert torch.equal(dst, src)
