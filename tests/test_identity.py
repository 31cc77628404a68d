"""A node's name is bound to its CURVE key. An insider (a key every daemon allows) that speaks
under another node's name, or sends what only the coordinator may send, is refused and logged,
never acted on: real daemons in network namespaces, CURVE on, a real version in flight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq.auth

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import Verdict
from weightwire.protocol.peer import (
    Heartbeat,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerMsg,
    VersionAbort,
    VersionStart,
    VersionVerdict,
)

from .conftest import FAST, NETNS, NETNS_WHY
from .ranks.big_trainer import weights
from .test_faults import MB, pair, publish_in_background

pytestmark = pytest.mark.skipif(not NETNS, reason=f"identity tests need namespaces: {NETNS_WHY}")
HERE = Path(__file__).parent
REFUSED = "peer message refused"


@pytest.fixture(scope="module")
def hosts() -> Iterator[LocalCluster]:
    """host0 coordinates; host1 runs the trainer (link throttled, so a version lasts seconds);
    host2 the engine. The key "insider" is in every daemon's allowed keys, but no daemon has it."""
    c = LocalCluster(hosts=3, use_netns=True, extra={**FAST, **MB})
    c.keys("insider")
    c.start()
    assert c.net is not None
    c.net.throttle(1, 100)
    c.wait_joined()
    yield c
    assert c.stop() == [0, 0, 0], f"logs in {c.workdir}"


def public_key(c: LocalCluster, node: str) -> str:
    public, _ = zmq.auth.load_certificate(str(c.workdir / "keys" / "public" / f"{node}.key"))
    return public.decode()


def insider(
    c: LocalCluster,
    *,
    key: str,
    victim: int,
    claim: str,
    msgs: list[PeerMsg],
    hold_s: float,
    repeat: int = 1,
    every_s: float = 0.0,
) -> subprocess.Popen[str]:
    """Start the insider (from host2's namespace) and return once its messages are sent."""
    target = c.daemons[victim]
    argv = [
        *c.prefix(2),
        sys.executable,
        "-m",
        "tests.ranks.insider",
        f"--endpoint={target.endpoint}",
        f"--server-key={public_key(c, target.node)}",
        f"--key-file={c.workdir / 'keys' / key / f'{key}.key_secret'}",
        f"--identity={claim}",
        f"--hold={hold_s}",
        f"--repeat={repeat}",
        f"--every={every_s}",
        *(msgspec.json.encode(m).decode() for m in msgs),
    ]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE.parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line and json.loads(line)["event"] == "sent", f"the insider did not send: {line!r}"
    return proc


def refusals(c: LocalCluster, host: int) -> list[dict[str, object]]:
    return [e for e in c.daemons[host].logs() if e.get("event") == REFUSED]


@pytest.mark.parametrize("key", ["insider", "host2"])
def test_heartbeat_under_the_coordinators_name_is_refused(hosts: LocalCluster, key: str) -> None:
    """One Heartbeat under the coordinator's name, from an allowed key (a member's, or one no
    member has), with the insider's connection held open: the victim stays joined throughout,
    the coordinator keeps it as a member, and a version it publishes meanwhile lands bitwise."""
    job = f"coordinator-name-{key}"
    tr, eng, dst = pair(hosts, job)
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    before = len(refusals(hosts, 1))
    pending = publish_in_background(tr, 2, weights(2))
    forged = Heartbeat(node="host0", incarnation="forged")
    proc = insider(hosts, key=key, victim=1, claim="host0", msgs=[forged], hold_s=6.0)
    seen: list[tuple[object, list[str]]] = []
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline:
        coordinator = fetch(hosts.daemons[1].socket)["coordinator"]
        members = (fetch(hosts.daemons[0].socket).get("coordination") or {}).get("members", [])
        seen.append((coordinator, members))
        time.sleep(0.1)
    assert proc.wait(15) == 0
    off = [s for s in seen if s[0] != "host0" or "host1" not in s[1]]
    assert not off, f"host1 was cut off the coordinator {len(off)} of {len(seen)} times: {off[:3]}"
    pending["thread"].join(30)  # type: ignore[attr-defined]
    assert "error" not in pending, pending
    eng.wait(2, timeout_s=30)
    assert torch.equal(dst, weights(2))
    logged = refusals(hosts, 1)[before:]
    assert logged and "host0" in str(logged[0]), "the forged heartbeat was not refused and logged"
    assert not [e for e in hosts.daemons[1].logs() if e.get("event") == "joined"][1:], "rejoined"
    tr.close()
    eng.close()


FORGERIES = {
    # a node "restarted": the engine host would drop host1 and fail the version it sends
    "restarted": ("host1", Heartbeat(node="host1", incarnation="forged")),
    # the coordinator says host1 is lost (coordinator-only message, insider key)
    "lost": ("host0", Membership(members=(), lost=("host1",))),
    # host1 gives up the version it is sending
    "abort": (
        "host1",
        VersionAbort(
            job="", version=2, source_node="host1", source_rank=0, code="aborted", message="forged"
        ),
    ),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_messages_mid_version_are_refused(hosts: LocalCluster, forgery: str) -> None:
    """Mid-version, the insider tells the engine host that the trainer host restarted, that the
    coordinator lost it, or that it aborted the version: refused and logged, and the version in
    flight completes bitwise."""
    job = f"forged-{forgery}"
    tr, eng, dst = pair(hosts, job)
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    done: list[tuple[object, float]] = []
    eng.on_version(lambda ev: done.append((ev, time.time())))
    before = len(refusals(hosts, 2))
    claim, msg = FORGERIES[forgery]
    if isinstance(msg, VersionAbort):
        msg = msgspec.structs.replace(msg, job=job)
    pending = publish_in_background(tr, 2, weights(2))
    time.sleep(0.5)
    proc = insider(hosts, key="insider", victim=2, claim=claim, msgs=[msg], hold_s=1.0)
    sent = time.time()
    eng.wait(2, timeout_s=30)
    assert torch.equal(dst, weights(2))
    pending["thread"].join(30)  # type: ignore[attr-defined]
    assert "error" not in pending, pending
    assert proc.wait(15) == 0
    assert done and done[-1][1] > sent, "version 2 completed before the forgery arrived"
    assert not [e for e, _ in done if isinstance(e, Exception)], done
    logged = refusals(hosts, 2)[before:]
    assert logged and claim in str(logged[0]), "the forgery was not refused and logged"
    assert not [e for e in hosts.daemons[2].logs() if e.get("event") == "peer lost"]
    tr.close()
    eng.close()


@pytest.mark.parametrize(("key", "claim"), [("insider", "host2"), ("host2", "ghost")])
def test_hello_under_a_members_name_or_with_a_members_key_is_refused(
    hosts: LocalCluster, key: str, claim: str
) -> None:
    """The coordinator binds a name to the key of its first hello while the name is a member:
    another key claiming host2 (with an endpoint of its own, to have host2's traffic) is
    refused, and so is host2's key claiming a second name. Membership, and every node's idea
    of where host2 listens, stay as they were; a version to host2 lands bitwise."""
    job = f"hello-{key}-{claim}"
    tr, eng, dst = pair(hosts, job)
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    where = {p["node"]: p["endpoint"] for p in fetch(hosts.daemons[1].socket)["peers"]}
    before = len(refusals(hosts, 0))
    forged = PeerHello(
        protocol=PROTOCOL_VERSION,
        member=Member(
            node=claim,
            endpoint=f"tcp://{hosts.address(2)}:1",
            incarnation="forged",
            public_key=public_key(hosts, key),
        ),
    )
    proc = insider(hosts, key=key, victim=0, claim=claim, msgs=[forged], hold_s=2.0)
    seen = []
    while proc.poll() is None:
        seen.append((fetch(hosts.daemons[0].socket).get("coordination") or {}).get("members"))
        time.sleep(0.1)
    assert proc.returncode == 0
    wrong = [m for m in seen if m != ["host0", "host1", "host2"]]
    assert seen and not wrong, f"membership changed {len(wrong)} of {len(seen)} times: {wrong[:3]}"
    after = {p["node"]: p["endpoint"] for p in fetch(hosts.daemons[1].socket)["peers"]}
    assert after == where, "a forged hello moved a member's endpoint"
    tr.publish(2, {"w": weights(2)})
    eng.wait(2, timeout_s=30)
    assert torch.equal(dst, weights(2))
    logged = refusals(hosts, 0)[before:]
    assert logged and logged[0]["message"] == "PeerHello", "the hello was not refused and logged"
    tr.close()
    eng.close()


def test_a_flood_of_peer_errors_is_one_line_a_while(hosts: LocalCluster) -> None:
    """5000 PeerError from an allowed key no member holds (errors are only logged, so they
    pass admission), 64 KiB of message each: each was a warning line with all of it (320
    MB of log a second from one insider); now one line per interval, the message cut. The
    victim keeps serving a version bitwise."""
    job = "peer-error-flood"
    tr, eng, dst = pair(hosts, job)
    d = hosts.daemons[2]
    lines = len(d.log_path.read_text().splitlines())
    forged = PeerError(code="x", message="y" * (64 << 10))
    proc = insider(
        hosts, key="insider", victim=2, claim="insider", msgs=[forged], hold_s=1.0, repeat=5000
    )
    assert proc.wait(30) == 0
    tr.publish(1, {"w": weights(1)})
    eng.wait(1)
    assert torch.equal(dst, weights(1))
    logged = [
        line
        for line in d.log_path.read_text().splitlines()[lines:]
        if "peer reported an error" in line
    ]
    assert 1 <= len(logged) <= 3, len(logged)
    assert max(map(len, logged)) < 2000
    tr.close()
    eng.close()


def test_a_verdict_under_another_nodes_name_is_refused(hosts: LocalCluster) -> None:
    """A member (host0, its own key and name) sends the trainer's node a VersionVerdict
    saying the engine rank on host2 verified the version, every 10 ms while a delta version
    is in flight, whose bytes the engine rank will find wrong (one changed behind
    weightwire's back). The verdict's node is the name it must come under: refused and
    logged. It was taken: the trainer's publish returned success while the engine rank
    failed the version (checksum)."""
    job = "forged-verdict"
    w = torch.arange(1 << 22, dtype=torch.float32)
    dst = torch.zeros_like(w)
    eng = Engine(0, 1, socket=hosts.daemons[2].socket, job=job, timeout_s=30, delta_area=0.5)
    tr = Trainer(0, 1, socket=hosts.daemons[1].socket, job=job, timeout_s=30, delta="on")
    try:
        eng.register({"w": dst})
        tr.register({"w": w})
        tr.publish(0)
        eng.wait(0)
        dst.view(torch.uint8)[4321] ^= 0x10  # not by weightwire
        w[::50] += 1
        before = len(refusals(hosts, 1))
        slot = next(
            r["slot"] for r in fetch(hosts.daemons[2].socket)["receiving"] if r["job"] == job
        )
        ok = Verdict(node="host2", slot=slot, rank=0, ok=True)
        verdicts = [VersionVerdict(job=job, version=1, verdict=ok)]
        proc = insider(
            hosts, key="host0", victim=1, claim="host0", msgs=verdicts, hold_s=0.5,
            repeat=300, every_s=0.01,
        )  # fmt: skip
        time.sleep(0.3)
        with pytest.raises(WeightwireError) as err:
            tr.publish(1)
        assert err.value.code is ErrorCode.CHECKSUM, err.value
        with pytest.raises(WeightwireError):
            eng.wait(1)
        assert proc.wait(15) == 0
        logged = refusals(hosts, 1)[before:]
        assert logged and "host2" in str(logged[0]), "the forged verdict was not refused"
        w[::70] += 1
        tr.publish(2)
        eng.wait(2)
        assert torch.equal(dst, w)
    finally:
        tr.close()
        eng.close()


def test_a_flood_of_stale_version_starts_is_one_line_a_while(hosts: LocalCluster) -> None:
    """The trainer's node (a planned source of the engine rank, its own key and name) sends
    the engine's node 2000 VersionStart of versions older than the last one complete there:
    each fails a version the rank never began and fences its source, as a late start
    should, but each was also a warning line; now one per interval. The rank is told of
    none of them, and the next version lands bitwise."""
    job = "stale-starts"
    tr, eng, dst = pair(hosts, job)
    tr.publish(3000, {"w": weights(1)})
    eng.wait(3000)
    heard: list[object] = []
    eng.on_version(heard.append)
    d = hosts.daemons[2]
    lines = len(d.log_path.read_text().splitlines())
    starts = [
        VersionStart(job=job, version=v, source_node="host1", source_rank=0) for v in range(2000)
    ]
    proc = insider(hosts, key="host1", victim=2, claim="host1", msgs=starts, hold_s=1.0)
    assert proc.wait(30) == 0
    failed = [
        line for line in d.log_path.read_text().splitlines()[lines:] if "version failed" in line
    ]
    assert 1 <= len(failed) <= 3, len(failed)
    tr.publish(3001, {"w": weights(2)})
    eng.wait(3001)
    assert torch.equal(dst, weights(2))
    assert [getattr(h, "version", None) for h in heard] == [3001], heard[:5]
    tr.close()
    eng.close()
