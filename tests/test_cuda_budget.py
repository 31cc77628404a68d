"""The cuda lane's budget of driver operations in flight (pure asyncio: runs anywhere)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from weightwire.transport.cuda.budget import OpBudget


def run(coro):  # type: ignore[no-untyped-def]
    return uvloop.run(asyncio.wait_for(coro, 10))


def test_takes_up_to_the_limit_then_waits_in_order() -> None:
    async def body() -> None:
        b = OpBudget(4)
        assert await b.take(3) == 3 and b.used == 3
        order: list[str] = []

        async def taker(name: str, n: int) -> None:
            await b.take(n)
            order.append(name)

        first = asyncio.ensure_future(taker("two", 2))
        second = asyncio.ensure_future(taker("one", 1))  # fits now, but waits its turn
        await asyncio.sleep(0.01)
        assert order == [] and b.used == 3
        b.give(3)
        await asyncio.gather(first, second)
        assert order == ["two", "one"] and b.used == 3 and b.peak == 3

    run(body())


def test_more_than_the_limit_takes_the_whole_budget() -> None:
    async def body() -> None:
        b = OpBudget(4)
        assert await b.take(100) == 4 and b.used == 4
        waiting = asyncio.ensure_future(b.take(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        b.give(4)
        assert await waiting == 1 and b.used == 1

    run(body())


def test_a_cancelled_waiter_takes_nothing_and_lets_the_next_one_in() -> None:
    async def body() -> None:
        b = OpBudget(2)
        await b.take(2)
        gone = asyncio.ensure_future(b.take(2))
        next_one = asyncio.ensure_future(b.take(1))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert not next_one.done()  # still full
        b.give(2)
        assert await next_one == 1 and b.used == 1

    run(body())


def test_cancelled_just_after_being_granted_gives_it_back() -> None:
    async def body() -> None:
        b = OpBudget(2)
        await b.take(2)
        late = asyncio.ensure_future(b.take(2))
        await asyncio.sleep(0.01)
        b.give(2)  # grants `late` ...
        late.cancel()  # ... which is cancelled before it runs again
        await asyncio.gather(late, return_exceptions=True)
        assert late.cancelled() and b.used == 0

    run(body())


def test_batches_cut_by_operations_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.transport.cuda import lanes

    monkeypatch.setattr(lanes, "BATCH_OPS", 4)
    monkeypatch.setattr(lanes, "BATCH_BYTES", 1000)

    def copy(i: int, nbytes: int, count: int = 1) -> lanes.Copy:
        return lanes.Copy(
            i,
            0,
            0,
            nbytes,
            None,
            "n",
            dst_device=0,
            count=count,
            src_stride=nbytes,
            dst_stride=nbytes,
        )

    cs = [
        copy(0, 100),
        copy(1, 100),
        copy(2, 100, count=2),
        copy(3, 100),
        copy(4, 901),
        copy(5, 5000),
        copy(6, 10),
    ]
    got = [[c.index for c in b] for b in lanes.batches(cs)]
    # ops 1, 1, 2 (a peer copy of two rows) fill the first; 100 + 901 bytes are too many
    assert got == [[0, 1, 2], [3], [4], [5], [6]]
    assert [c.index for b in lanes.batches(cs) for c in b] == list(range(7))
    assert lanes.batches([]) == []
