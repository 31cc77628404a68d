"""A rank's bucket posts: several buckets in one message (a fast pack's posts), and the
checks on each of them. Buckets without writes, so no transport is involved."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import uvloop

from weightwire.daemon.publisher import Publisher
from weightwire.protocol.errors import ErrorCode, VersionError
from weightwire.protocol.local import PublishResult
from weightwire.protocol.plan import Bucket, RankPlan
from weightwire.transport.base import Transport


async def _no_transport(*_: object) -> Transport:
    raise AssertionError("no writes, no transport")


def publisher(
    results: list[PublishResult], pick: Callable[..., Awaitable[Transport]] = _no_transport
) -> Publisher:
    """Rank 0's publisher, its results in `results`; `pick` names the transport to a node."""
    return Publisher(
        job="j",
        rank=0,
        pick=pick,
        reply=results.append,
        announce=lambda *_: None,
        source_region=lambda _: None,  # type: ignore[arg-type,return-value]
    )


def _publisher(results: list[PublishResult]) -> Publisher:
    pub = publisher(results)
    plan = RankPlan(
        plan_hash="h", rank=0, staging_bytes=0, buckets=tuple(Bucket(index=i) for i in range(4))
    )
    pub.set_plan(plan)
    return pub


def test_buckets_posted_together_complete_the_version() -> None:
    async def main() -> list[PublishResult]:
        results: list[PublishResult] = []
        pub = _publisher(results)
        pub.begin(1, "h")
        pub.bucket_ready(1, (0, 2, 1))
        pub.bucket_ready(1, (3,))
        await pub.drain(5)
        return results

    (result,) = uvloop.run(main())
    assert result.ok and result.version == 1
    assert len(result.buckets) == 4 and all(posted > 0 for posted, _ in result.buckets)


@pytest.mark.parametrize(
    ("posts", "code", "words"),
    [
        (((0, 0),), ErrorCode.DUPLICATE, "bucket 0 of version 1 was already posted"),
        (((1,), (2, 1)), ErrorCode.DUPLICATE, "bucket 1 of version 1 was already posted"),
        (((0, 4),), ErrorCode.INVALID, "bucket 4 does not exist (the plan has 4)"),
    ],
)
def test_a_bad_bucket_in_a_post_is_named_and_nothing_of_it_is_posted(
    posts: tuple[tuple[int, ...], ...], code: ErrorCode, words: str
) -> None:
    async def main() -> None:
        pub = _publisher([])
        pub.begin(1, "h")
        *good, bad = posts
        for p in good:
            pub.bucket_ready(1, p)
        before = set(pub.run.posted) if pub.run else set()
        with pytest.raises(VersionError) as err:
            pub.bucket_ready(1, bad)
        assert err.value.code is code and words in err.value.message
        assert pub.run is not None and pub.run.posted == before
        await pub.drain(5)

    uvloop.run(main())


def test_a_version_on_a_plan_whose_regions_changed_under_the_same_hash_is_refused() -> None:
    """The plan back under the same hash with other regions (elastic: a replica came or
    went; here the same region behind a new IPC handle). A version begun by a rank that
    fetched the plan before is refused with PLAN_CHANGED, so the rank fetches it again (a
    rank packing in place writes to its own plan's regions); once it has, it begins. End
    to end: tests/test_elastic.py, the restarted replica."""
    from weightwire.protocol.errors import PlanError
    from weightwire.protocol.regions import CudaKey, RegionDescriptor, RegionKeys

    def plan(handle: bytes) -> RankPlan:
        key = CudaKey(host_id="h", device_uuid="GPU-0", ipc_handle=handle)
        region = RegionDescriptor(id=3, node="e", kind="gpu", length=64, keys=RegionKeys(cuda=key))
        return RankPlan(
            plan_hash="h", rank=0, staging_bytes=0, buckets=(Bucket(index=0),), regions=(region,)
        )

    async def main() -> list[PublishResult]:
        results: list[PublishResult] = []
        pub = publisher(results)
        old = plan(b"\1" * 64)
        pub.set_plan(old)
        pub.served = old.regions  # what GetPlan gave the rank
        pub.begin(1, "h")
        pub.bucket_ready(1, (0,))
        await pub.drain(5)
        new = plan(b"\2" * 64)
        pub.set_plan(new)
        with pytest.raises(PlanError) as err:
            pub.begin(2, "h")
        assert err.value.code is ErrorCode.PLAN_CHANGED and "fetch the plan again" in str(err.value)
        pub.served = new.regions  # fetched again
        pub.begin(2, "h")
        pub.bucket_ready(2, (0,))
        await pub.drain(5)
        return results

    results = uvloop.run(main())
    assert [(r.version, r.ok) for r in results] == [(1, True), (2, True)]
