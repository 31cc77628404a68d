"""A planned source (an insider with its node's valid key) telling an engine's node that a
bucket landed, naming ranges the plan does not route from that source rank there. Real
daemons in network namespaces, the forgery sent from the trainer host's namespace under
its name and key (`test_delta_forgery`).

A bucket's ranges bound where its payloads may write, so they must be among those the plan
routes from its sender rank to the engine rank (`Expect.planned`, as its trailer's must
be): a well-formed range that is not (here: the tensor's second 64 bytes) once was
checksummed and the version completed; now it fails the version (`unauthorized`, naming
the range) and the next lands bitwise. A note under a trainer rank the plan does not have
that node write there (a rank of another node, say) is dropped at the engine's daemon."""

from __future__ import annotations

import pytest
import torch

from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.peer import BucketLanded, LandedPart, PeerMsg, VersionStart

from .conftest import NETNS, NETNS_WHY
from .test_delta_forgery import delta_pair, failed_then_lands, forge, weights
from .test_delta_forgery import hosts as hosts  # the module's cluster

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")


def note(job: str, rank: int, ranges: tuple[tuple[int, int, int, int, int], ...]) -> list[PeerMsg]:
    """Version 2 started by trainer rank `rank` of host0, and a bucket of it landed."""
    parts = tuple(LandedPart(slot=s, ranges=ranges) for s in range(4))
    return [
        VersionStart(job=job, version=2, source_node="host0", source_rank=rank),
        BucketLanded(
            job=job, version=2, source_node="host0", source_rank=rank, bucket=0, parts=parts
        ),
    ]


def test_a_bucket_naming_an_unplanned_range_fails_the_version(hosts: LocalCluster) -> None:
    job = "note-unplanned-range"
    with delta_pair(hosts, job) as (tr, eng, dst):
        region = eng._declared[0][1][0].region
        forge(hosts, note(job, 0, ((region, 64, 64, 1, 0),)))  # well formed, not planned
        with pytest.raises(WeightwireError) as err:
            tr.publish(2, {"w": weights(2)})
        assert err.value.code is ErrorCode.UNAUTHORIZED, err.value
        assert f"range ({region}, 64, 64, 1, 0)" in err.value.message, err.value.message
        failed_then_lands(tr, eng, dst)


def test_a_bucket_under_a_rank_not_planned_from_its_node_is_dropped(
    hosts: LocalCluster,
) -> None:
    job = "note-unplanned-rank"
    with delta_pair(hosts, job) as (tr, eng, dst):
        region = eng._declared[0][1][0].region
        plan = tr.plan()
        (w,) = [w for b in plan.buckets for w in b.writes][:1]
        honest = ((region, w.dst_offset, w.length, w.count, w.dst_stride),)
        forge(hosts, note(job, 5, honest))  # rank 0's own range, under a rank 5 of host0
        res = tr.publish(2, {"w": weights(2)})
        eng.wait(2)
        assert torch.equal(dst, weights(2))
        assert res.delta_bytes > 0, "version 2 went dense"
