"""A planned source (an insider with its node's valid key) telling an engine's node that a
bucket landed, of a version it never started there: the engine applied and checksummed
it, and from that first bucket on held no verified version (`DeltaReceiver.held` -1), so
the next real delta version failed (stale base) and went dense. A note counts only for a
version its source started here (`VersionStart`, the same connection, before it), from
the source rank that started it. Real daemons in network namespaces, the forgery sent from
the trainer host's namespace under its name and key."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weightwire.client import Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import Goodbye, TrailersReady
from weightwire.protocol.peer import BucketLanded, LandedPart

from .conftest import NETNS, NETNS_WHY
from .test_delta_forgery import N, delta_pair, forge, weights
from .test_delta_forgery import hosts as hosts  # the module's cluster

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")


def publish_behind(tr: Trainer, version: int) -> tuple[threading.Thread, dict[str, BaseException]]:
    """`tr.publish(version)` on a thread of its own; its error, if any, in the dict."""
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            tr.publish(version, {"w": weights(version)})
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.parametrize("claim", ["future", "other_rank"])
def test_a_note_of_a_version_never_started_changes_nothing(hosts: LocalCluster, claim: str) -> None:
    job = f"forged-note-{claim}"
    with delta_pair(hosts, job) as (tr, eng, dst):
        region = eng._declared[0][1][0].region
        # a range it could honestly name (the whole tensor), no payload
        parts = tuple(LandedPart(slot=s, ranges=((region, 0, N * 4, 1, 0),)) for s in range(4))
        # a version far ahead that nobody started; or version 2 under a rank that is not
        # the one that will start it
        version, rank = (1000, 0) if claim == "future" else (2, 7)
        note = BucketLanded(
            job=job, version=version, source_node="host0", source_rank=rank, bucket=0, parts=parts
        )
        forge(hosts, [note])
        res = tr.publish(2, {"w": weights(2)})
        eng.wait(2)
        assert torch.equal(dst, weights(2))
        assert res.delta_bytes > 0, "version 2 went dense: the forged note failed its delta"


def test_an_engine_that_never_answers_apply_fails_the_version_in_time(
    hosts: LocalCluster,
) -> None:
    """A hung engine rank: every write landed, it is told to apply, and it never answers.
    The trainer's publish fails with a typed error (`timeout`) within its timeout, the
    engine's wait never reports the version complete, and once it answers again the next
    version lands."""
    with delta_pair(hosts, "hung-apply", trainer_timeout_s=4) as (tr, eng, dst):
        answer = eng._notices._send
        eng._notices._send = lambda msg: None  # applies, never says so
        t0 = time.monotonic()
        with pytest.raises(WeightwireError) as err:
            tr.publish(2, {"w": weights(2)})
        took = time.monotonic() - t0
        assert err.value.code is ErrorCode.TIMEOUT and took < 15, (err.value, took)
        with pytest.raises(WeightwireError):
            eng.wait(2, timeout_s=2)
        eng._notices._send = answer
        tr.publish(3, {"w": weights(3)})
        eng.wait(3)
        assert torch.equal(dst, weights(3))


def test_an_engine_that_leaves_while_applying_fails_the_version_at_once(
    hosts: LocalCluster,
) -> None:
    """The engine rank applies, never answers, and leaves (its session closed): the
    version fails at its source then, not at the trainer's timeout, typed."""
    with delta_pair(hosts, "gone-apply", trainer_timeout_s=20) as (tr, eng, _):
        eng._notices._send = lambda msg: None
        t, out = publish_behind(tr, 2)
        time.sleep(1.0)  # every write landed, the engine applied, its verdict awaited
        t0 = time.monotonic()
        eng.close()
        t.join(30)
        took = time.monotonic() - t0
        err = out.get("error")
        print("after the engine left:", repr(err), f"{took:.1f} s")
        assert isinstance(err, WeightwireError), err
        assert took < 10, f"the publish waited {took:.1f} s for a verdict that cannot come"


def test_a_trainer_gone_before_its_trailers_never_completes_the_version(
    hosts: LocalCluster,
) -> None:
    """A trainer rank posts every bucket of a delta version (its payloads land) and leaves
    before its trailers: the engine never reports the version complete, and a new rank's
    next version lands bitwise."""
    job = "gone-before-trailers"
    with delta_pair(hosts, job, trainer_timeout_s=5) as (tr, eng, dst):
        send = tr._conn.send
        tr._conn.send = lambda msg: None if isinstance(msg, TrailersReady) else send(msg)
        t, out = publish_behind(tr, 2)
        time.sleep(1.0)  # its buckets landed; the trailers never come
        send(Goodbye())  # the rank leaves
        with pytest.raises(WeightwireError) as err:
            eng.wait(2, timeout_s=10)
        print("engine:", err.value.code, err.value.message)
        t.join(30)
        assert isinstance(out.get("error"), WeightwireError), out
        tr2 = Trainer(0, 1, socket=hosts.daemons[0].socket, job=job, timeout_s=30, delta="on")
        try:
            tr2.register({"w": weights(3)})
            for version in (3, 4):
                tr2.publish(version, {"w": weights(version)})
                eng.wait(version)
                assert torch.equal(dst, weights(version)), version
        finally:
            tr2.close()
