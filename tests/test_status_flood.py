"""A member floods a daemon with StatusQuery (what `weightwire status --cluster` sends).

Each query used to be answered with a status document made afresh (every session, region,
peer, and on the coordinator every job's ranks collected twice), at whatever rate a member
with a valid key sent them: 20000 queries, 20000 documents built and sent back. Now a
daemon answers each asking node at most a few times a second (a token bucket; a cluster
status asks each node once), and a document is made at most once per short interval and
shared. Past that, queries are dropped with one log line a while; the asker times out as
it would with a daemon that is down. The daemon keeps serving: a version lands bitwise
during the flood and `status --cluster` from a node of the cluster still gets every
daemon's answer. Real daemons in network namespaces; the flooder is a real member
(tests/attack/statusflood.py).

The coordinator's CPU time over the flood is printed (not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.daemon.coordinator import MAX_JOBS_PER_NODE
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS, NETNS_WHY

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
HERE = Path(__file__).parent
QUERIES = 20000
TENSORS = 200


@pytest.fixture(scope="module")
def hosts() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=3, use_netns=True, extra=FAST)
    c.keys("flooder")  # a key every daemon allows, held by no daemon
    c.start()
    c.wait_joined()
    yield c
    assert c.stop() == [0, 0, 0], f"logs in {c.workdir}"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood(c: LocalCluster, target: str, count: int, kind: str = "status") -> dict[str, object]:
    keys = c.workdir / "keys"
    spec = dict(
        node="flooder", secret_key=str(keys / "flooder" / "flooder.key_secret"),
        allowed_dir=str(keys / "public"), coordinator=c.daemons[0].endpoint,
        coordinator_key=c.coordinator_key(), address=c.address(2),
        target=target, count=count, hold_s=3.0, kind=kind,
    )  # fmt: skip
    argv = [*c.prefix(2), sys.executable, str(HERE / "attack" / "statusflood.py"), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    assert "failed" not in out, (out, done.stderr[-3000:])
    return out


class Pair:
    """A trainer rank on host `t` and an engine rank on host `e` of `job`, `tensors`
    tensors; `publish` lands the next version and checks it bitwise."""

    def __init__(self, c: LocalCluster, job: str, t: int, e: int, tensors: int = 1) -> None:
        self.ws = {f"w{i}": torch.arange(1024, dtype=torch.float32) + i for i in range(tensors)}
        self.dst = {k: torch.zeros_like(v) for k, v in self.ws.items()}
        self.tr = Trainer(0, 1, socket=c.daemons[t].socket, job=job, timeout_s=30)
        self.eng = Engine(0, 1, socket=c.daemons[e].socket, job=job, timeout_s=30)
        self.version = 0
        self.eng.register(self.dst)
        self.tr.register(self.ws)

    def publish(self) -> None:
        self.version += 1
        for w in self.ws.values():
            w.add_(1)
        self.tr.publish(self.version)
        self.eng.wait(self.version)
        assert all(torch.equal(self.dst[k], self.ws[k]) for k in self.ws)


@contextmanager
def pair(c: LocalCluster, job: str, t: int, e: int, tensors: int = 1) -> Iterator[Pair]:
    p = Pair(c, job, t, e, tensors)
    try:
        p.publish()
        yield p
    finally:
        p.tr.close()
        p.eng.close()


def timed(c: LocalCluster, target: str, kind: str) -> tuple[dict[str, object], float, str]:
    """`flood` of QUERIES messages, all sent: its outcome, seconds, and every daemon's CPU."""
    cpu0, t0 = cpus(c), time.monotonic()
    out = flood(c, target, QUERIES, kind)
    cpu1, t1 = cpus(c), time.monotonic()
    assert out["sent"] == QUERIES, out
    return out, t1 - t0, spent(cpu0, cpu1)


def cpus(c: LocalCluster) -> list[float]:
    return [cpu_s(int(fetch(d.socket)["pid"])) for d in c.daemons]


def spent(before: list[float], after: list[float]) -> str:
    pairs = enumerate(zip(before, after, strict=True))
    return "CPU " + ", ".join(f"host{i} {b - a:.2f} s" for i, (a, b) in pairs)


def logged(c: LocalCluster, host: int, event: str) -> list[dict[str, object]]:
    return [e for e in c.daemons[host].logs() if e.get("event") == event]


def test_a_status_query_flood_is_answered_at_a_bounded_rate_and_the_daemon_serves_on(
    hosts: LocalCluster,
) -> None:
    c = hosts
    with pair(c, "status-flood", 0, 1, TENSORS) as p:
        out, seconds, cpu = timed(c, "host0", "status")
        print(
            f"\n{QUERIES} StatusQuery at the coordinator: {out['answers']} answered over "
            f"{seconds:.1f} s (sent in {out['send_s']} s); {cpu}"
        )
        answers = int(out["answers"])  # type: ignore[call-overload]
        assert 1 <= answers <= 20 + 10 * seconds, out  # the bucket: burst + rate x time
        p.publish()  # the daemon serves on
        whole = fetch(c.daemons[1].socket, cluster=True)["nodes"]
        assert all("error" not in whole[n] for n in ("host0", "host1", "host2")), whole
        dropped = logged(c, 0, "status queries dropped")
        assert 1 <= len(dropped) <= 5, len(dropped)  # one line a while, not one per query
        assert dropped[0]["peer"] == "flooder", dropped[0]


def rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_an_advert_flood_of_made_up_jobs_is_bounded_and_the_coordinator_serves_on(
    hosts: LocalCluster,
) -> None:
    c = hosts
    pid = int(fetch(c.daemons[0].socket)["pid"])
    cpu0, rss0, t0 = cpu_s(pid), rss(pid), time.monotonic()
    out = flood(c, "host0", QUERIES, kind="advertise")
    cpu1, rss1, t1 = cpu_s(pid), rss(pid), time.monotonic()
    jobs = fetch(c.daemons[0].socket)["coordination"]["jobs"]
    flooded = [j for j in jobs if j.startswith("flood-")]
    print(
        f"\n{QUERIES} Advertise of made-up jobs at the coordinator: {len(flooded)} jobs kept, "
        f"coordinator CPU {cpu1 - cpu0:.2f} s over {t1 - t0:.1f} s, "
        f"RSS +{(rss1 - rss0) / 2**20:.1f} MiB, told {out['problems']}"
    )
    assert out["sent"] == QUERIES, out
    assert len(flooded) == MAX_JOBS_PER_NODE, len(flooded)
    told = out["problems"]
    assert told == {"too_large": QUERIES - MAX_JOBS_PER_NODE}, told  # each refusal typed
    refused = logged(c, 0, "advert refused")
    assert 1 <= len(refused) <= 5, len(refused)  # one line a while
    assert "holds ranks in 256 jobs already" in str(refused[0]["reason"]), refused[0]
    deadline = time.monotonic() + 20
    while True:  # the flooder has left: its jobs go with it (they used to stay for ever)
        jobs = fetch(c.daemons[0].socket)["coordination"]["jobs"]
        if not [j for j in jobs if j.startswith("flood-")]:
            break
        assert time.monotonic() < deadline, len(jobs)
        time.sleep(0.2)
    with pair(c, "after-advert-flood", 0, 1):
        pass  # a version of a new job lands bitwise


def test_a_flood_of_hellos_with_new_incarnations_is_acted_on_at_a_bounded_rate(
    hosts: LocalCluster,
) -> None:
    """A member says hello 20000 times, each with a new incarnation (as a daemon restarted
    20000 times). The coordinator answered each (a welcome and the membership) and, for a
    new incarnation, dropped the node's adverts and broadcast the membership to every
    member, which each took as a restart of that node: every daemon of the cluster worked
    for every hello. Now hellos are acted on at most once a second per node (burst 5);
    the rest are dropped with one log line a while. Every daemon's CPU time is printed."""
    c = hosts
    cpu0, t0 = cpus(c), time.monotonic()
    out = flood(c, "host0", QUERIES, kind="rejoin")
    cpu1, t1 = cpus(c), time.monotonic()
    print(f"\n{QUERIES} hellos, new incarnations: {out['answers']} answers; {spent(cpu0, cpu1)}")
    assert out["sent"] == QUERIES, out
    answers = int(out["answers"])  # type: ignore[call-overload]
    assert answers <= 2 * (5 + (t1 - t0)) + 10, out  # a welcome and a membership per hello
    dropped = logged(c, 0, "hellos dropped")
    assert 1 <= len(dropped) <= 5 and dropped[0]["peer"] == "flooder", dropped
    with pair(c, "after-hello-flood", 0, 2):
        pass  # a version of a new job lands bitwise


def test_heartbeats_flapping_between_two_incarnations_are_one_restart(
    hosts: LocalCluster,
) -> None:
    """A member sends a daemon (not the coordinator) 20000 heartbeats: a new incarnation,
    then its own, in turn. Each new one was a restart (peer lost: a line, a fence, its
    versions failed) and each old one its return (peer back: a line, and every job of the
    daemon advertised to the coordinator again, which planned again): 30004 log lines,
    1.4 s of that daemon's CPU and 0.5 s of the coordinator's. A node that restarted does
    not come back as the incarnation it restarted from: now it is lost once, and back when
    the membership says which incarnation it is. A version lands bitwise after."""
    c = hosts
    with pair(c, "heartbeat-flap", 1, 2) as p:
        lines = len(c.daemons[1].log_path.read_text().splitlines())
        cpu0 = cpus(c)
        out = flood(c, "host1", QUERIES, kind="flap")
        cpu1 = cpus(c)
        new = c.daemons[1].logs()[lines:]
        print(f"\n{QUERIES} flapping heartbeats: {len(new)} lines at host1; {spent(cpu0, cpu1)}")
        assert out["sent"] == QUERIES, out
        flaps = [e for e in new if e.get("peer") == "flooder" and "peer" in str(e.get("event"))]
        assert len(flaps) <= 4, [e.get("event") for e in flaps][:10]
        p.publish()


def test_a_flood_of_hellos_at_a_daemon_that_does_not_coordinate_is_answered_at_a_bounded_rate(
    hosts: LocalCluster,
) -> None:
    """A member says hello 20000 times to host1, which does not coordinate. Each was
    answered (a `not_coordinator` error), as fast as they came, where the coordinator acts
    on one hello a second per node name; now host1 answers at the coordinator's rate too,
    the rest dropped with one log line a while. host1 keeps serving: a version from its
    trainer rank lands bitwise at host2, and its status answers."""
    c = hosts
    with pair(c, "hello-flood-member", 1, 2) as p:
        out, seconds, cpu = timed(c, "host1", "hello")
        answers = int(out["not_coordinator"])  # type: ignore[call-overload]
        print(
            f"\n{QUERIES} hellos at a daemon that does not coordinate: {answers} answered "
            f"over {seconds:.1f} s; {cpu}"
        )
        assert 1 <= answers <= 5 + seconds + 5, out  # the bucket: burst + rate x time
        dropped = logged(c, 1, "hellos dropped")
        assert 1 <= len(dropped) <= 5 and dropped[0]["peer"] == "flooder", dropped
        p.publish()  # host1 serves on
        assert fetch(c.daemons[1].socket)["node"] == "host1"


def test_an_advert_naming_another_nodes_region_is_refused_naming_the_field(
    hosts: LocalCluster,
) -> None:
    """A member advertises an engine rank whose region descriptor names host1. The
    coordinator took it (the planner routed the writes to the advertising node all the
    same, but the advert stood, naming a region of another node). Now the advert is refused
    whole with a typed `invalid` PlanProblem naming the field, it is not planned or listed,
    and the coordinator serves on."""
    c = hosts
    out = flood(c, "host0", 1, kind="foreign-region")
    assert out["sent"] == 1, out
    assert out["problems"] == {"invalid": 1}, out
    told = str(out["told"])
    assert "ranks[1].regions[0].node is 'host1'" in told and "flooder" in told, told
    assert "foreign-region" not in fetch(c.daemons[0].socket)["coordination"]["jobs"]
    with pair(c, "after-foreign-region", 0, 1):
        pass  # a version of a new job lands bitwise
