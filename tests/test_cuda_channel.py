"""The channel that carries the immediates of cuda copies between two daemons of one host
(transport/cuda/channel.py): real Unix datagram sockets, no GPU needed.

A receiver's queue holds only `net.unix.max_dgram_qlen` datagrams (10 by default). One
immediate per datagram on a non-blocking socket dropped every immediate past that when a
batch of copies landed at once (GPU: two trainer ranks' 16 writes into one engine rank, 13
delivered; the version timed out with its bytes all there). Now a batch goes in one
datagram, a full queue is waited out, and what cannot be sent is reported, never dropped
unsaid."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from weightwire.transport.cuda.channel import PER_DATAGRAM, Channel


@pytest.fixture
def pair(
    tmp_path,
) -> Iterator[tuple[Channel, Channel, list[tuple[int, str]], asyncio.AbstractEventLoop]]:  # type: ignore[no-untyped-def]
    loop = asyncio.new_event_loop()
    got: list[tuple[int, str]] = []
    sender, receiver = Channel(str(tmp_path)), Channel(str(tmp_path))
    sender.open(loop, lambda imm, src: None, lambda node: None)
    receiver.open(loop, lambda imm, src: got.append((imm, src)), lambda node: None)
    yield sender, receiver, got, loop
    sender.close()
    receiver.close()
    loop.close()


def drain(loop: asyncio.AbstractEventLoop) -> None:
    """Let the receiver's reader run until its queue is empty."""
    loop.run_until_complete(asyncio.sleep(0.05))


def test_a_batch_larger_than_the_receivers_queue_arrives_whole(pair) -> None:  # type: ignore[no-untyped-def]
    """Many batches sent before the receiver reads at all (its queue: a few datagrams)."""
    sender, receiver, got, loop = pair
    sent = []
    for batch in range(8):
        imms = [batch * 100_000 + i for i in range(2 * PER_DATAGRAM + 7 if batch == 0 else 16)]
        sent += imms
        assert sender.send_imms(receiver.path, "host0", imms)
        drain(loop)
    assert got == [(imm, "host0") for imm in sent]


def test_a_receiver_that_never_reads_is_reported_not_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Its queue fills; a send that cannot get in within its wait says so (the writes
    then fail peer_lost) instead of losing the immediates."""
    loop = asyncio.new_event_loop()
    sender, deaf = Channel(str(tmp_path)), Channel(str(tmp_path))
    sender.open(loop, lambda imm, src: None, lambda node: None)
    deaf.open(loop, lambda imm, src: None, lambda node: None)  # the loop never runs
    try:
        sent = 0
        while sent < 4096 and sender.send_imms(deaf.path, "host0", [sent], wait_s=0.02):
            sent += 1
        assert 1 <= sent < 4096  # a few datagrams went in, then one was refused, not lost
    finally:
        sender.close()
        deaf.close()
        loop.close()


def test_a_peer_gone_is_reported(pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sender, _, _, _ = pair
    assert not sender.send_imms(str(tmp_path / "nobody.sock"), "host0", [1, 2, 3])
