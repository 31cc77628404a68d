"""SGLang's memory saver, what runs without a GPU: file descriptors passed to the daemon
over its real fd socket (SCM_RIGHTS), the messages, and the error that says what to set
when VMM memory cannot be shared. GPU tests: tests/test_memory_saver_gpu.py."""

from __future__ import annotations

import array
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from weightwire.client.connection import DaemonConnection
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.memory import fdpass, vmm
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, RegistrationError, WeightwireError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import (
    CudaRegion,
    Hello,
    LocalMessage,
    RemapRegion,
    Welcome,
)

from .conftest import FAST


@pytest.fixture
def inbox() -> Iterator[fdpass.Inbox]:
    with tempfile.TemporaryDirectory() as d:
        box = fdpass.Inbox(os.path.join(d, "ww.sock.fds"), 0o600)
        yield box
        box.close()


def _file(content: bytes) -> int:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.write(fd, content)
    return fd


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16)


def test_fds_cross_a_real_unix_socket_under_their_token(inbox: fdpass.Inbox) -> None:
    a, b = _file(b"first allocation"), _file(b"second")
    token, other = fdpass.new_token(), fdpass.new_token()
    fdpass.send(inbox.path, token, [a, b])
    fdpass.send(inbox.path, other, [b])
    os.close(a)  # the kernel passed copies: the sender's may go at once
    got = inbox.claim(token)
    assert [_read(fd) for fd in got] == [b"first allocation", b"second"]
    assert b not in got  # copies, not the sender's descriptors
    (alone,) = inbox.claim(other)
    assert _read(alone) == b"second"
    for fd in (*got, alone, b):
        os.close(fd)
    with pytest.raises(fdpass.FdPassError, match="no file descriptors were passed"):
        inbox.claim(token)  # each batch is claimed once


def test_stray_datagrams_and_replayed_tokens_are_dropped_and_closed(
    inbox: fdpass.Inbox,
) -> None:
    fd = _file(b"x")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        s.sendmsg([b"short"], rights, 0, inbox.path)  # not a token
        s.sendto(b"t" * fdpass.TOKEN_BYTES, inbox.path)  # a token with no descriptor
    token = fdpass.new_token()
    fdpass.send(inbox.path, token, [fd])
    fdpass.send(inbox.path, token, [fd])  # the same token again: refused, closed
    assert inbox.pending() == 1
    (got,) = inbox.claim(token)
    assert _read(got) == b"x"
    os.close(got)
    os.close(fd)
    with pytest.raises(fdpass.FdPassError):
        inbox.claim(b"t" * fdpass.TOKEN_BYTES)


def test_unclaimed_fds_expire_and_are_closed() -> None:
    with tempfile.TemporaryDirectory() as d:
        now = [100.0]
        box = fdpass.Inbox(os.path.join(d, "s"), 0o600, ttl_s=60.0, clock=lambda: now[0])
        fd = _file(b"y")
        before = len(os.listdir("/proc/self/fd"))
        fdpass.send(box.path, fdpass.new_token(), [fd])
        assert box.pending() == 1
        assert len(os.listdir("/proc/self/fd")) == before + 1  # the inbox's copy
        now[0] += 61
        assert box.pending() == 0  # expired: its copy closed
        assert len(os.listdir("/proc/self/fd")) == before
        os.close(fd)
        box.close()
        assert not os.path.exists(box.path)


def test_send_names_the_socket_it_could_not_reach() -> None:
    fd = _file(b"z")
    with pytest.raises(fdpass.FdPassError, match=r"/nonexistent/ww\.fds"):
        fdpass.send("/nonexistent/ww.fds", fdpass.new_token(), [fd])
    with pytest.raises(ValueError):
        fdpass.send("/nonexistent/ww.fds", b"short", [fd])
    os.close(fd)


def test_messages_round_trip_and_old_peers_read_them() -> None:
    codec: Codec[LocalMessage] = Codec(LocalMessage)
    info = CudaRegion(
        device_uuid="GPU-x", ipc_handle=b"", offset=512, vmm_token=b"k" * 16, vmm_sizes=(2 << 20,)
    )
    for msg in (RemapRegion(region=3, req=9), RemapRegion(region=3, cuda=info, req=10)):
        back, _ = codec.decode(codec.encode(msg))
        assert back == msg
    # a CudaRegion from before VMM decodes with its defaults (fields only grow)
    old = msgspec.msgpack.encode({"device_uuid": "GPU-x", "ipc_handle": b"h" * 64})
    assert msgspec.msgpack.decode(old, type=CudaRegion).vmm_sizes == ()
    w = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"type": "welcome", "protocol": 1, "node": "n", "session": "s"}),
        type=Welcome,
    )
    assert w.fd_socket == ""


def test_unshareable_vmm_memory_is_refused_saying_what_to_set() -> None:
    """torch_memory_saver's allocations allow no shareable handle: the error names the
    parameter and says exactly what to change (no GPU needed: refused before any export)."""
    pytest.importorskip("torch")
    from weightwire.client import cuda

    chunk = vmm.Chunk(base=1 << 40, size=2 << 20, handle_types=0, device=0)
    with pytest.raises(RegistrationError) as err:
        cuda._vmm_region(
            [chunk], "GPU-x", chunk.base, "/run/ww.sock.fds", "parameter model.layers.0.w"
        )
    msg = err.value.message
    assert err.value.code is ErrorCode.INVALID
    assert "parameter model.layers.0.w" in msg
    assert "--enable-memory-saver" in msg and "torch_memory_saver" in msg
    assert "expandable_segments:True" in msg
    assert "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in msg
    ok = vmm.Chunk(base=1 << 40, size=2 << 20, handle_types=vmm.HANDLE_TYPE_POSIX_FD, device=0)
    with pytest.raises(RegistrationError, match="no fd socket"):
        cuda._vmm_region([ok], "GPU-x", ok.base, "", "parameter w")


@pytest.fixture(scope="module")
def daemon() -> Iterator[LocalCluster]:
    c = LocalCluster(hosts=1, extra=FAST)
    c.start()
    yield c
    assert c.stop() == [0]


def test_daemon_offers_an_fd_socket_and_refuses_bad_remaps(daemon: LocalCluster) -> None:
    """The Welcome names the daemon's fd socket (a real socket with the local socket's
    mode, taking descriptors); a remap of a region the rank does not own is refused as
    UNKNOWN_REGION, and the daemon keeps serving."""
    sock = daemon.daemons[0].socket
    with DaemonConnection(sock) as eng:
        welcome = eng.request(
            Hello(protocol=PROTOCOL_VERSION, role="engine", rank=0, world_size=1, job="ms")
        )
        assert isinstance(welcome, Welcome) and welcome.fd_socket == sock + ".fds"
        st = os.stat(welcome.fd_socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == stat.S_IMODE(os.stat(sock).st_mode)
        fd = _file(b"w")
        fdpass.send(welcome.fd_socket, fdpass.new_token(), [fd])  # taken (then expires)
        os.close(fd)
        for cuda in (None, CudaRegion(device_uuid="GPU-x", ipc_handle=b"h" * 64)):
            with pytest.raises(WeightwireError) as err:
                eng.request(RemapRegion(region=12345, cuda=cuda))
            assert err.value.code is ErrorCode.UNKNOWN_REGION
            assert "region 12345" in err.value.message
    with DaemonConnection(sock) as again:  # still serving
        again.request(Hello(protocol=PROTOCOL_VERSION, role="admin"))


def test_sglang_release_and_resume_hooks_reach_the_workers_engine() -> None:
    """The plugin's hooks on SGLang's release/resume_memory_occupation call the engine of
    the manager's model, only when the request covers the weights (no tags: all kinds)."""
    from types import SimpleNamespace

    from weightwire.adapters.sglang import plugin

    calls: list[str] = []
    engine = SimpleNamespace(
        release_gpu_memory=lambda: calls.append("release"),
        resume_gpu_memory=lambda: calls.append("resume"),
    )
    model = object()
    manager = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    plugin._BINDINGS[id(model)] = plugin.Binding(
        engine=engine, model=model, mode="rules", rank=0, world_size=1, key="tp0of1", registered={}
    )
    try:
        for tags, hit in ((None, True), ([], True), (["weights"], True), (["kv_cache"], False)):
            calls.clear()
            req = SimpleNamespace(tags=tags)
            plugin.before_release_memory(manager, req)
            plugin.after_resume_memory(None, manager, req)
            assert calls == (["release", "resume"] if hit else []), tags
        other = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=1)))
        plugin.before_release_memory(other, SimpleNamespace(tags=None))  # not ours: nothing
        assert calls == []
    finally:
        plugin._BINDINGS.pop(id(model))


def test_engine_regions_are_the_overlapping_spans_of_its_tensors() -> None:
    """One region per allocation (cudaMalloc) or per run of VMM allocations that tensors
    straddle; allocations that merely touch stay separate regions."""
    pytest.importorskip("torch")
    from weightwire.client.cuda import merge

    a, b = 1 << 30, 1 << 31
    spans = [
        (a, 40, "a1"),  # allocation a, twice (two tensors in it)
        (b, 80, "b-straddler"),  # a tensor over two VMM chunks, [b, b+20) and [b+20, b+80)
        (a, 40, "a2"),
        (b, 20, "b-first-chunk"),
        (b + 80, 10, "touching"),  # starts where the run before it ends: its own region
    ]
    assert merge(spans) == [
        (a, 40, ["a1", "a2"]),
        (b, 80, ["b-straddler", "b-first-chunk"]),
        (b + 80, 10, ["touching"]),
    ]


def test_a_flood_of_unclaimed_fds_is_bounded(inbox: fdpass.Inbox) -> None:
    """A rank that passes descriptors and never claims them cannot run the daemon out of
    them: beyond MAX_PENDING_FDS the oldest batches are closed, the newest kept."""
    fd = _file(b"f")
    before = len(os.listdir("/proc/self/fd"))
    tokens = [fdpass.new_token() for _ in range(fdpass.MAX_PENDING_FDS // 100 + 3)]
    for token in tokens:
        fdpass.send(inbox.path, token, [fd] * 100)
        inbox.pending()  # the daemon drains as requests come
    held = len(os.listdir("/proc/self/fd")) - before
    assert held <= fdpass.MAX_PENDING_FDS
    got = inbox.claim(tokens[-1])
    assert len(got) == 100
    with pytest.raises(fdpass.FdPassError):
        inbox.claim(tokens[0])  # the oldest were closed
    for g in got:
        os.close(g)
    os.close(fd)


def test_unclaimed_batches_never_block_the_fd_socket_for_other_ranks(daemon: LocalCluster) -> None:
    """A rank passes batches of descriptors and never claims them (it died between the
    send and its registration, or means harm). The daemon read its fd socket only when a
    VMM registration claimed a batch, so they stayed in the kernel's queue (a few
    datagrams deep: net.unix.max_dgram_qlen), the queue filled, and every other rank's
    send timed out; no rank could then get as far as the claim that would have drained it,
    and unclaimed batches never expired: VMM registration was gone until a restart. The
    daemon now drains the socket as datagrams arrive (closing the oldest past
    MAX_PENDING_FDS, and any past their time): another rank's batch goes through."""
    d = daemon.daemons[0]
    path = d.socket + ".fds"
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        flood = min(qlen + 8, 4 * fdpass.MAX_PENDING_FDS // fdpass.MAX_FDS)
        for _ in range(flood):
            fdpass.send(path, fdpass.new_token(), [fd] * fdpass.MAX_FDS, timeout_s=5)
        fdpass.send(path, fdpass.new_token(), [fd], timeout_s=5)  # another rank's: not stuck
    finally:
        os.close(fd)
    held = int(fetch(d.socket)["open_fds"])
    assert held <= fdpass.MAX_PENDING_FDS + fdpass.MAX_FDS + 200, held
