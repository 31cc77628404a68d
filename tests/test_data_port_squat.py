"""Connections to a daemon's tcp data port that never say hello, held by a host with no
key (reopened as soon as the daemon closes one). At most `tcp_max_unauthenticated` (64)
connections may wait for their handshake at once, and the daemon used to refuse every
new one past that: a host that kept 64 silent connections open (each closed after the
handshake timeout, and opened again at once) shut every trainer out of that daemon's
data port, and versions could not be written to it. Now a new connection takes the place
of the oldest that has not authenticated: a real writer authenticates within a round trip
or two, so the squatter's connections go first. Real daemons in network namespaces; the
squatter is a process of its own in a third."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, NETNS_WHY, serve
from .test_status_flood import pair

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
HERE = Path(__file__).parent
SQUAT = 80  # more than tcp_max_unauthenticated


@pytest.fixture(scope="module")
def three() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=3, use_netns=True, extra=FAST))


def test_a_host_squatting_the_data_port_does_not_shut_trainers_out(three: LocalCluster) -> None:
    c = three
    tcp = c.daemons[1].ready["transports"]["tcp"]  # type: ignore[index]
    argv = [*c.prefix(2), sys.executable, str(HERE / "attack" / "silent.py")]
    argv += [str(tcp["host"]), str(tcp["port"]), str(SQUAT), "12"]  # type: ignore[index]
    squat = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert squat.stdout is not None
    try:
        assert json.loads(squat.stdout.readline())["event"] == "holding"
        with pair(c, "squat", 0, 1) as p:  # its data connections made during the squat
            p.publish()
        assert squat.poll() is None, "the squat ended before the versions did"
    finally:
        squat.kill()
        squat.wait()
