"""What the plan lets each sender write at an engine rank (`client/delta/planned.py`, no
I/O): a trailer must be its planned sender's and name exactly its planned ranges (each
once, any order); a bucket's ranges must be among its sender's."""

from __future__ import annotations

import pytest

from weightwire.client.delta.frames import TrailerHead
from weightwire.client.delta.planned import Planned, PlanRefused
from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.local import ApplyVersion

A = [(1, 0, 64, 1, 0), (1, 128, 64, 1, 0)]  # rank 0's
B = [(1, 64, 64, 1, 0), (1, 192, 64, 2, 128)]  # rank 2's


def told() -> Planned:
    msg = ApplyVersion(
        rank=3,
        version=5,
        region=9,
        trailers=((0, 200), (256, 200)),
        plan="p",
        senders=(("t0", 0), ("t1", 2)),
        planned=(tuple(A), tuple(B)),
    )
    p = Planned.told(msg, None)
    assert p is not None and Planned.told(msg, p) is p  # the same plan again: kept
    return p


def trailer(sender: int, ranges: list[tuple[int, int, int, int, int]]) -> TrailerHead:
    return TrailerHead(sender, 5, 4, 0, tuple(ranges), ())


def test_honest_trailers_in_any_order_pass() -> None:
    told().check_trailers([trailer(0, A[::-1]), trailer(2, B)])


@pytest.mark.parametrize(
    ("trailers", "needle"),
    [
        ([trailer(0, [A[0], B[0]]), trailer(2, B)], "names range (1, 64, 64, 1, 0)"),
        ([trailer(0, [A[0]]), trailer(2, B)], "names 1 ranges, not the 2"),
        ([trailer(0, [A[0], A[0]]), trailer(2, B)], "each once"),
        ([trailer(2, B), trailer(0, A)], "says it is of sender rank 2"),
    ],
    ids=["another_ranks_range", "one_left_out", "one_twice", "slots_swapped"],
)
def test_a_trailer_claiming_other_than_its_ranges_is_refused(
    trailers: list[TrailerHead], needle: str
) -> None:
    with pytest.raises(PlanRefused) as err:
        told().check_trailers(trailers)
    assert err.value.code is ErrorCode.UNAUTHORIZED and needle in str(err.value), err.value


def test_a_bucket_names_only_its_senders_ranges() -> None:
    p = told()
    p.check(2, B[1:], "bucket 0")
    with pytest.raises(PlanRefused, match=r"range \(1, 0, 64, 1, 0\), not one the plan"):
        p.check(2, [A[0]], "bucket 0")
    with pytest.raises(PlanRefused, match="the plan has it write nothing"):
        p.check(7, [A[0]], "bucket 0")


def test_an_old_daemon_says_nothing_and_a_half_said_plan_is_refused() -> None:
    bare = ApplyVersion(rank=3, version=5, region=9, trailers=((0, 200),))
    assert Planned.told(bare, None) is None
    half = ApplyVersion(
        rank=3, version=5, region=9, trailers=((0, 200),), senders=(("t0", 0),), planned=()
    )
    with pytest.raises(PlanRefused) as err:
        Planned.told(half, None)
    assert err.value.code is ErrorCode.INVALID
