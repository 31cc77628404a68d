"""A planned source (an insider with its node's valid key) forging what a delta version's
engine applies: a `BucketLanded` whose ranges lie about their blocks (a count of 2^40 blocks
of one byte at stride 0; ranges of more bytes than the engine holds). Real daemons in network
namespaces, the forgery sent from the trainer host's namespace under its name and key.

The engine rank once walked every block it was told of: one forged note held its thread for
hours (and its memory grew a tensor view per block), so the rank answered nothing again. A
range must now be blocks a plan could write (at least one; strides no smaller than the
length; within the registered bytes of its region) and a version's ranges at most the
registered bytes, else the version fails with a checksum error naming the range; the next
version goes dense and lands bitwise. (The insider starts the version itself first: a note
of a version its source rank did not start is dropped, `test_delta_notes_insider`.)"""

from __future__ import annotations

import contextlib
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
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.peer import BucketLanded, LandedPart, PeerMsg, VersionStart

from .conftest import FAST, NETNS, NETNS_WHY, serve

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
HERE = Path(__file__).parent
N = 64 << 10  # float32 elements of the one tensor


@pytest.fixture(scope="module")
def hosts() -> Iterator[LocalCluster]:
    """host0 (coordinator) runs the trainer, host1 the engine."""
    yield from serve(LocalCluster(hosts=2, use_netns=True, extra=FAST))


def forge(c: LocalCluster, msgs: list[PeerMsg]) -> None:
    """Send `msgs` to host1's peer socket as host0 (its key, its name), from its namespace."""
    public, _ = zmq.auth.load_certificate(str(c.workdir / "keys" / "public" / "host1.key"))
    argv = [
        *c.prefix(0),
        sys.executable,
        "-m",
        "tests.ranks.insider",
        f"--endpoint={c.daemons[1].endpoint}",
        f"--server-key={public.decode()}",
        f"--key-file={c.workdir / 'keys' / 'host0' / 'host0.key_secret'}",
        "--identity=host0/forged",
        "--hold=0.5",
        *(msgspec.json.encode(m).decode() for m in msgs),
    ]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["event"] == "sent", out.stdout


@contextlib.contextmanager
def delta_pair(
    c: LocalCluster, job: str, trainer_timeout_s: float = 30
) -> Iterator[tuple[Trainer, Engine, torch.Tensor]]:
    """A trainer rank on host0 and an engine rank on host1 (its tensor `dst`), delta on,
    versions 0 and 1 landed bitwise: the engine holds version 1, verified."""
    dst = torch.zeros(N)
    eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=30, delta_area=0.5)
    tr = Trainer(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=trainer_timeout_s, delta="on")
    try:
        eng.register({"w": dst})
        tr.register({"w": weights(0)})
        for version in (0, 1):
            tr.publish(version, {"w": weights(version)})
            eng.wait(version)
            assert torch.equal(dst, weights(version)), version
        assert eng.delta is not None and eng.delta.held == 1
        yield tr, eng, dst
    finally:
        tr.close()
        eng.close()


def failed_then_lands(tr: Trainer, eng: Engine, dst: torch.Tensor) -> None:
    """Version 2 is never reported complete, and versions 3 and 4 land bitwise."""
    with pytest.raises(WeightwireError):
        eng.wait(2, timeout_s=10)
    for version in (3, 4):
        tr.publish(version, {"w": weights(version)})
        eng.wait(version)
        assert torch.equal(dst, weights(version)), version


def weights(version: int) -> torch.Tensor:
    w = torch.arange(N, dtype=torch.float32)
    w[version::97] += version  # a sparse change each version: a delta
    return w


RANGES = {
    # 2^40 blocks of one byte, all at the same place
    "count": (lambda region, nbytes: ((region, 0, 1, 1 << 40, 0),), "would overlap"),
    # blocks that overlap each other (stride below the length)
    "overlap": (lambda region, nbytes: ((region, 0, 64, 4, 8),), "would overlap"),
    # a block past the registered bytes
    "past_end": (lambda region, nbytes: ((region, nbytes - 8, 64, 1, 0),), "not within"),
    # the whole region three times over: more than the rank holds (each costs a full pass)
    "repeated": (
        lambda region, nbytes: tuple((region, 0, nbytes, 1, i) for i in range(3)),
        "more than the",
    ),
}


@pytest.mark.parametrize("lie", sorted(RANGES))
def test_forged_bucket_ranges_fail_the_version_and_the_next_lands(
    hosts: LocalCluster, lie: str
) -> None:
    job = f"forged-ranges-{lie}"
    with delta_pair(hosts, job) as (tr, eng, dst):
        region = eng._declared[0][1][0].region  # the engine's weight region
        make, needle = RANGES[lie]
        ranges = make(region, N * 4)
        parts = tuple(LandedPart(slot=s, ranges=ranges) for s in range(4))
        note = BucketLanded(
            job=job, version=2, source_node="host0", source_rank=0, bucket=0, parts=parts
        )
        # the insider starts version 2 itself (a note counts only for a version its source
        # rank started), as trainer rank 0 of host0 will: the real start changes nothing
        start = VersionStart(job=job, version=2, source_node="host0", source_rank=0)
        t0 = time.monotonic()
        forge(hosts, [start, note])
        with pytest.raises(WeightwireError) as err:
            tr.publish(2, {"w": weights(2)})
        assert err.value.code is ErrorCode.CHECKSUM, err.value
        assert "range" in err.value.message and needle in err.value.message, err.value.message
        assert time.monotonic() - t0 < 20
        failed_then_lands(tr, eng, dst)
