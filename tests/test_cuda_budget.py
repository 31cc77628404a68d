"""The cuda lane's pure parts: its budget of driver operations in flight, and how a
lane's copies are cut into chunks (one event each). Run anywhere."""

from __future__ import annotations

import pytest

from weightwire.transport.cuda.budget import OpBudget


def test_takes_up_to_the_limit_then_refuses_until_given_back() -> None:
    b = OpBudget(4)
    assert b.try_take(3) == 3 and b.used == 3
    assert b.try_take(2) == 0 and b.used == 3  # does not fit: nothing taken
    assert b.try_take(1) == 1 and b.used == 4
    b.give(3)
    assert b.try_take(2) == 2 and b.used == 3 and b.peak == 4


def test_more_than_the_limit_takes_the_whole_budget_once_it_is_free() -> None:
    b = OpBudget(4)
    assert b.try_take(1) == 1
    assert b.try_take(100) == 0
    b.give(1)
    assert b.try_take(100) == 4 and b.used == 4
    assert b.try_take(1) == 0
    b.give(4)
    assert b.used == 0 and b.try_take(0) == 1  # every batch costs at least its event


def test_chunks_cut_by_operations_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.transport.cuda import copies

    monkeypatch.setattr(copies, "BATCH_OPS", 4)
    monkeypatch.setattr(copies, "BATCH_BYTES", 1000)

    def copy(i: int, nbytes: int, count: int = 1, node: str = "n") -> copies.Copy:
        return copies.Copy(
            i, 0, 0, nbytes, node, dst_device=0, count=count, src_stride=nbytes,
            dst_stride=nbytes,
        )  # fmt: skip

    cs = [
        copy(0, 100),
        copy(1, 100),
        copy(2, 100, count=2),
        copy(3, 100, node="m"),
        copy(4, 901),
        copy(5, 5000),
        copy(6, 10),
    ]
    got = copies.chunks(cs)
    # ops 1, 1, 2 (a peer copy of two rows) fill the first; 100 + 901 bytes are too many
    assert [[c.index for c in ch.copies] for ch in got] == [[0, 1, 2], [3], [4], [5], [6]]
    assert [ch.ops for ch in got] == [5, 2, 2, 2, 2]  # the event included
    assert [ch.nbytes for ch in got] == [400, 100, 901, 5000, 10]
    assert [ch.node for ch in got] == ["n", "m", "n", "n", "n"]
    mixed = copies.chunks([copy(0, 10), copy(1, 10, node="m")])
    assert len(mixed) == 1 and mixed[0].node == ""  # its copies write to two nodes
    assert copies.chunks([]) == []
