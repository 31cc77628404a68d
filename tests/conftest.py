import os
import sys
from collections.abc import Iterator

import pytest

# `tests` is importable as a package so transport suites can share the conformance tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightwire.harness import netns
from weightwire.harness.localcluster import LocalCluster

NETNS, NETNS_WHY = netns.available()
FAST = {
    "heartbeat-interval-s": "0.2",
    "heartbeat-timeout-s": "1.5",
    "session-timeout-s": "3",
    "stall-timeout-s": "10",
    "max-message-bytes": str(4 << 20),
}


def pytest_report_header(config: pytest.Config) -> list[str]:
    if NETNS:
        return ["weightwire end-to-end hosts: network namespaces joined by veth (root)"]
    return [f"weightwire end-to-end hosts: LOOPBACK, because {NETNS_WHY}"]


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    """Two real daemons, each in its own network namespace when we are root."""
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra=FAST))


def serve(c: LocalCluster) -> Iterator[LocalCluster]:
    """A cluster fixture's body: every daemon started and joined, the cluster yielded, and
    every daemon stopped with exit code 0 after."""
    c.start()
    c.wait_joined()
    yield c
    codes = c.stop()
    assert codes == [0] * len(codes), f"daemons exited with {codes}; logs in {c.workdir}"
