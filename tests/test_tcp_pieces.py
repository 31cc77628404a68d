"""Writes that land in pieces (a GPU region's, through a bounded bounce buffer), without
sockets or a GPU: the piece arithmetic, and the receive machine in each security mode
moving a write several times larger than the piece through a sink that gives its memory
piece by piece, as the GPU sink does. The GPU path itself: tests/test_tcp_gpu.py."""

from __future__ import annotations

import os

import pytest

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, TransferError
from weightwire.transport.tcp import auth, handshake, wire
from weightwire.transport.tcp.bounce import piece_bytes, pieces
from weightwire.transport.tcp.data import DataHello, Write
from weightwire.transport.tcp.regions import RegionTable

from .test_tcp_auth_wire import Reader, connect, sealed, write

MiB = auth.RECORD
HELLO_OFF = wire.encode(DataHello(protocol=PROTOCOL_VERSION, node="trainer"))


@pytest.mark.parametrize("cap", [1, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 64 * MiB])
@pytest.mark.parametrize("length", [0, 1, MiB - 1, MiB, MiB + 1, 7 * MiB + 3, 200 * MiB])
def test_pieces_cover_the_write_in_whole_records(length: int, cap: int) -> None:
    step = piece_bytes(cap)
    assert step % MiB == 0 and MiB <= step <= max(cap, MiB) and step > cap - MiB
    got = list(pieces(length, cap))
    at = 0
    for i, (start, n) in enumerate(got):
        assert start == at and 0 < n <= step
        if i < len(got) - 1:
            assert n % MiB == 0  # no sealed record straddles two pieces
        at += n
    assert at == length and len(got) == -(-length // step)


class PieceSink:
    """Gives a write's memory `cap` bytes at a time from a staging buffer of its own and
    copies each piece into the region when the next is asked for (and the last at
    `landed`): the GPU sink's protocol, with host memory on both sides."""

    def __init__(self, table: RegionTable, cap: int, fail_at: int = -1) -> None:
        self.table = table
        self.cap = cap
        self.fail_at = fail_at  # the `done` at which the next piece fails (-1: never)
        self.staging = bytearray()
        self.largest = 0
        self.log: list[tuple[str, int]] = []
        self._dst: memoryview | None = None
        self._at = 0

    def _stage(self, n: int) -> memoryview:
        if n > len(self.staging):
            self.staging = bytearray(n)
        self.largest = max(self.largest, len(self.staging))
        return memoryview(self.staging)[:n]

    def target(self, w: Write, peer: str, private: bool = False) -> memoryview:
        self._dst, self._at = self.table.target(w, peer), 0
        return self._stage(min(w.length, self.cap))

    def _flush(self, done: int) -> None:
        assert self._dst is not None
        self._dst[self._at : done] = self.staging[: done - self._at]

    def piece(self, w: Write, done: int) -> memoryview:
        self.log.append(("piece", done))
        if done == self.fail_at:
            raise TransferError("the device copy failed")
        self._flush(done)
        self._at = done
        return self._stage(min(w.length - done, self.cap))

    def landed(self, w: Write) -> None:
        self._flush(w.length)
        self.log.append(("landed", w.length))


def reader(mode: auth.Mode, cap: int, fail_at: int = -1) -> tuple[Reader, PieceSink]:
    r = Reader(mode)
    sink = PieceSink(r.table, cap, fail_at)
    off = mode is auth.Mode.OFF
    acceptor = None if off else handshake.Acceptor("engine", mode, r.tickets)
    r.m = wire.ReceiveMachine(sink, acceptor)
    return r, sink


def frames(r: Reader, ws: list[tuple[Write, bytes]]) -> list[bytes]:
    """Each write as it comes on the connection, after its handshake."""
    if r.mode is auth.Mode.OFF:
        assert len(r.feed(HELLO_OFF)) == 1
        return [wire.encode(w) + data for w, data in ws]
    ch = connect(r)
    return [sealed(ch, w, data) for w, data in ws]


MODES = [auth.Mode.OFF, auth.Mode.AUTH, auth.Mode.ENCRYPT]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", [4096, MiB + 17])
def test_a_write_larger_than_the_piece_lands_bitwise_and_counts_at_its_last(
    mode: auth.Mode, step: int
) -> None:
    """3 MiB + 80 bytes through 1 MiB pieces: four pieces, each in the region before the
    next is taken, the write landed (its immediate delivered) only after the last; then a
    small write through the same sink."""
    r, sink = reader(mode, MiB)
    data, small = os.urandom(3 * MiB + 80), os.urandom(5)
    big, tail = frames(r, [(write(len(data), offset=7), data), (write(5, offset=1, seq=2), small)])
    assert r.feed(big[:-40], step) == []  # all but the last piece's last bytes
    assert sink.log == [("piece", MiB), ("piece", 2 * MiB), ("piece", 3 * MiB)]
    assert bytes(r.mem[7 : 7 + 3 * MiB]) == data[: 3 * MiB]  # the full pieces are in
    assert not any(r.mem[7 + 3 * MiB :])  # the last one is not, nor is it landed
    events = r.feed(big[-40:] + tail, step)
    assert [type(e) for e in events] == [wire.Landed, wire.Landed]
    assert [e.write.seq for e in events if isinstance(e, wire.Landed)] == [1, 2]
    assert sink.log[3:] == [("landed", len(data)), ("landed", 5)]
    assert bytes(r.mem[7 : 7 + len(data)]) == data and not any(r.mem[7 + len(data) :])
    assert bytes(r.mem[1:6]) == small and r.mem[0] == 0 and r.mem[6] == 0
    assert sink.largest == MiB and r.m.bytes_landed == len(data) + 5


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_piece_fails_the_write_typed_and_it_never_lands(mode: auth.Mode) -> None:
    r, sink = reader(mode, MiB, fail_at=2 * MiB)
    data = os.urandom(3 * MiB)
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(frames(r, [(write(len(data), imm=9, seq=4), data)])[0], MiB)
    assert err.value.seq == 4 and err.value.code is ErrorCode.TRANSFER
    assert "device copy failed" in err.value.message
    assert ("landed", len(data)) not in sink.log
    assert bytes(r.mem[:MiB]) == data[:MiB] and not any(r.mem[2 * MiB :])


@pytest.mark.parametrize("mode", MODES)
def test_a_piece_that_would_split_a_record_is_refused(mode: auth.Mode) -> None:
    """A sink's pieces are whole records (bounce.piece_bytes): one that is not would make a
    sealed record straddle two pieces, so the machine refuses it rather than mis-land it."""
    r, _ = reader(mode, MiB + MiB // 2)
    data = os.urandom(2 * MiB)
    with pytest.raises(wire.FrameViolation) as err:
        r.feed(frames(r, [(write(len(data)), data)])[0])
    assert "sink gave" in err.value.message and not any(r.mem)
