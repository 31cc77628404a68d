"""Counting immediates at a destination: every version a rank began hears how it ended."""

from __future__ import annotations

from weightwire.daemon.completion import RankCompletion
from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.local import VersionComplete, VersionFailed
from weightwire.protocol.plan import Expect, version_low


def rank() -> tuple[RankCompletion, list[VersionComplete | VersionFailed]]:
    told: list[VersionComplete | VersionFailed] = []
    rc = RankCompletion(
        job="j",
        rank=0,
        expect=Expect(rank=0, slot=0, count=2, nbytes=64, sources=("a", "b")),
        plan_hash="p",
        notify=lambda job, r, msg: told.append(msg),
    )
    return rc, told


def test_a_version_overtaken_by_a_later_one_is_reported_failed() -> None:
    rc, told = rank()
    rc.on_start(5, "a")
    rc.on_imm(version_low(5))  # one of its two writes
    rc.on_start(6, "b")
    rc.on_imm(version_low(6))
    rc.on_imm(version_low(6))
    assert [(type(m).__name__, m.version) for m in told] == [
        ("VersionComplete", 6),
        ("VersionFailed", 5),
    ]
    failed = told[1]
    assert isinstance(failed, VersionFailed)
    assert failed.code == ErrorCode.ABORTED.value and "superseded by version 6" in failed.message
    rc.on_imm(version_low(5))  # its last write, late: never completes it
    rc.fail(5, ErrorCode.PEER_LOST, "late")  # nor fails it twice
    assert len(told) == 2 and rc.last_complete == 6


def test_a_version_announced_after_a_later_one_completed_is_reported_failed() -> None:
    """Its writes all came, but its start arrived only after version 8 completed: it
    never completes, and the rank is told so once, however many sources announce it."""
    rc, told = rank()
    rc.on_imm(version_low(7))
    rc.on_imm(version_low(7))
    rc.on_start(8, "a")
    rc.on_imm(version_low(8))
    rc.on_imm(version_low(8))
    rc.on_start(7, "a")
    rc.on_start(7, "b")
    rc.on_start(8, "b")  # the second source of a completed version: nothing to say
    assert [(type(m).__name__, m.version) for m in told] == [
        ("VersionComplete", 8),
        ("VersionFailed", 7),
    ]
    assert version_low(7) not in rc.current


def test_an_abort_after_completion_changes_nothing() -> None:
    rc, told = rank()
    rc.on_start(3, "a")
    rc.on_imm(version_low(3))
    rc.on_imm(version_low(3))
    rc.fail(3, ErrorCode.ABORTED, "b failed elsewhere")
    assert [type(m).__name__ for m in told] == ["VersionComplete"]


def test_a_failed_verification_is_reported_at_once_without_a_fence() -> None:
    """Every write of the version landed before the engine verified it: nothing of it can
    land late, so a checksum failure fences no source (a fence would close their streams
    while the last acks may still be owed, and the trainer would hear peer_lost instead of
    this verdict); the verdict goes out at once, typed."""
    told: list[VersionComplete | VersionFailed] = []
    fenced: list[tuple[str, ...]] = []
    verdicts: list[tuple[int, bool, str]] = []

    async def fence(nodes: tuple[str, ...], reason: str) -> None:
        fenced.append(nodes)

    rc = RankCompletion(
        job="j",
        rank=0,
        expect=Expect(rank=0, slot=0, count=2, nbytes=64, sources=("a",), delta_region=1),
        plan_hash="p",
        notify=lambda job, r, msg: told.append(msg),
        fence=fence,
        apply=lambda rc, version: None,
        verdict=lambda rc, version, ok, code, message: verdicts.append((version, ok, code)),
    )
    rc.on_start(3, "a")
    rc.on_imm(version_low(3))
    rc.on_imm(version_low(3))
    rc.on_applied(3, False, ErrorCode.CHECKSUM.value, "xxh3 differs")
    assert verdicts == [(3, False, "checksum")] and fenced == []
    assert [(type(m).__name__, m.version) for m in told] == [("VersionFailed", 3)]


def test_a_start_of_a_version_never_seen_here_is_not_told_to_the_rank() -> None:
    """No byte of version 3 came; its start arrives after version 8 completed (stale, or
    forged in a loop): it fails for any wait, but the rank is not told of a version it
    never saw."""
    rc, told = rank()
    rc.on_start(8, "a")
    rc.on_imm(version_low(8))
    rc.on_imm(version_low(8))
    for _ in range(3):
        rc.on_start(3, "a")
    assert [(type(m).__name__, m.version) for m in told] == [("VersionComplete", 8)]
    assert rc.failed[3].code == ErrorCode.ABORTED.value


def test_a_completed_version_started_again_by_the_same_source_rank_fails() -> None:
    """A source rank that starts a version it already completed here (a trainer rank
    resumed from a checkpoint, on another node's daemon or after its daemon restarted)
    hears at once that it fails, its writes are refused from then on; another source
    rank's late start of it stays a note. Before, any start of a completed version was
    ignored: the new run never completed nor failed (its publish waited out its timeout)
    while its writes landed over the version the rank holds."""
    rc, told = rank()
    rc.on_start(5, "a", 0)
    rc.on_imm(version_low(5))
    rc.on_imm(version_low(5))
    rc.on_start(5, "b", 1)  # another source rank, late: nothing to say
    assert [(type(m).__name__, m.version) for m in told] == [("VersionComplete", 5)]
    assert 5 not in rc.failed
    rc.on_imm(version_low(5))  # the run again: a write before its start
    rc.on_start(5, "a", 0)
    assert [(type(m).__name__, m.version) for m in told] == [
        ("VersionComplete", 5),
        ("VersionFailed", 5),
    ]
    failed = told[1]
    assert isinstance(failed, VersionFailed) and failed.code == ErrorCode.ABORTED.value
    assert "already completed here" in failed.message and "version 6 or later" in failed.message
    assert rc.dead_lows.get(version_low(5)) == 5  # its later writes are refused
    assert version_low(5) not in rc.current
    rc.on_start(5, "b", 1)  # b starts it again too: settled already, nothing more
    assert len(told) == 2 and rc.last_complete == 5
    rc.on_start(6, "a", 0)  # the next version goes through
    rc.on_imm(version_low(6))
    rc.on_imm(version_low(6))
    assert [(type(m).__name__, m.version) for m in told][-1] == ("VersionComplete", 6)
