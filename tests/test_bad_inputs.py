"""Bad input gets a clear, typed error naming what was wrong, and the daemon keeps serving."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch
import zmq

from weightwire.client import Engine, Rows, Shard, Trainer
from weightwire.client.connection import DaemonConnection
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol import local as local_msgs
from weightwire.protocol.errors import (
    ErrorCode,
    PlanError,
    ProtocolError,
    RegistrationError,
    VersionError,
    WeightwireError,
)
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import (
    AbortVersion,
    BeginVersion,
    BucketReady,
    DeclareDestinations,
    DeclareSources,
    Error,
    GetPlan,
    Goodbye,
    Hello,
    LocalMessage,
    Ping,
    RegisterRegion,
    StatusReply,
    StatusRequest,
    WaitVersion,
)
from weightwire.protocol.tensors import Box, DestTensor, Fp8BlockQuant, Piece, SourceTensor

W = torch.arange(64, dtype=torch.float32).reshape(8, 8)


def pair(cluster: LocalCluster, job: str, **engine_tensors: torch.Tensor) -> tuple[Trainer, Engine]:
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=10)
    tr.register({"w": W.clone()})
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=10)
    eng.register(engine_tensors or {"w": torch.zeros(8, 8)})
    return tr, eng


def healthy_sync(cluster: LocalCluster, job: str) -> None:
    """The daemons still serve a good job end to end, bitwise."""
    tr, eng = pair(cluster, job)
    dst = torch.zeros(8, 8)
    eng.close()
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job + "-2", timeout_s=10)
    eng.register({"w": dst})
    tr.close()
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job + "-2", timeout_s=10)
    tr.register({"w": W * 3})
    tr.publish(1)
    eng.wait(1)
    assert torch.equal(dst, W * 3)
    tr.close()
    eng.close()


def test_engine_needs_a_tensor_no_trainer_has(cluster: LocalCluster) -> None:
    tr, eng = pair(cluster, "unknown-name", w=torch.zeros(8, 8), ghost=torch.zeros(4))
    with pytest.raises(PlanError) as err:
        tr.prepare(timeout_s=10)
    assert "ghost" in err.value.message and "no trainer declared" in err.value.message
    with pytest.raises(PlanError) as err2:
        eng.wait(1, timeout_s=5)
    assert "ghost" in err2.value.message
    tr.close()
    eng.close()
    healthy_sync(cluster, "after-unknown-name")


def test_publish_of_unregistered_tensor_or_wrong_dtype_or_shape(cluster: LocalCluster) -> None:
    tr, eng = pair(cluster, "publish-checks")
    with pytest.raises(RegistrationError) as e1:
        tr.publish(1, {"nope": W})
    assert e1.value.code is ErrorCode.UNKNOWN_TENSOR and "nope" in e1.value.message
    with pytest.raises(RegistrationError) as e2:
        tr.publish(1, {"w": W.to(torch.float16)})
    assert e2.value.code is ErrorCode.DTYPE_MISMATCH and "float16" in e2.value.message
    with pytest.raises(RegistrationError) as e3:
        tr.publish(1, {"w": torch.zeros(4, 8)})
    assert e3.value.code is ErrorCode.SHAPE_MISMATCH and "[4, 8]" in e3.value.message
    tr.publish(1)  # the rank itself is fine afterwards
    eng.wait(1)
    tr.close()
    eng.close()


def test_trainer_and_engine_disagree_on_dtype_or_shape(cluster: LocalCluster) -> None:
    tr, eng = pair(cluster, "dtype-mismatch", w=torch.zeros(8, 8, dtype=torch.bfloat16))
    with pytest.raises(PlanError) as err:
        tr.prepare(timeout_s=10)
    assert "dtype_mismatch" in err.value.message and "w is bfloat16" in err.value.message
    tr.close()
    eng.close()
    with pytest.raises(RegistrationError) as err2:
        e = Engine(0, 1, socket=cluster.daemons[1].socket, job="shape-mismatch")
        try:
            e.register({"w": torch.zeros(4, 8)}, {"w": Rows((8, 8), 0, 3)})
        finally:
            e.close()
    assert err2.value.code is ErrorCode.SHAPE_MISMATCH


def test_duplicate_registrations(cluster: LocalCluster) -> None:
    tr = Trainer(0, 2, socket=cluster.daemons[0].socket, job="dupes")
    tr.register({"w": W[:4]}, layout=Shard(0, 0, 2), global_shapes={"w": (8, 8)})
    with pytest.raises(RegistrationError) as e1:
        tr.register({"w": W[:4]}, layout=Shard(0, 0, 2), global_shapes={"w": (8, 8)})
    assert e1.value.code is ErrorCode.DUPLICATE
    with pytest.raises(RegistrationError) as e2:
        Trainer(0, 2, socket=cluster.daemons[0].socket, job="dupes")
    assert e2.value.code is ErrorCode.DUPLICATE and "already registered" in e2.value.message
    with pytest.raises(RegistrationError) as e3:
        Trainer(1, 3, socket=cluster.daemons[0].socket, job="dupes")
    assert "world size 3" in e3.value.message
    # the daemon itself refuses a name twice, whatever the client library does
    with DaemonConnection(cluster.daemons[0].socket) as raw:
        raw.request(
            Hello(protocol=PROTOCOL_VERSION, role="trainer", rank=1, world_size=2, job="dupes")
        )
        spec = SourceTensor(name="x", dtype="float32", shape=(4,))
        with pytest.raises(RegistrationError) as e4:
            raw.request(DeclareSources(tensors=(spec, spec)))
        assert e4.value.code is ErrorCode.DUPLICATE and "x" in e4.value.message
        bad_box = SourceTensor(
            name="y", dtype="float32", shape=(4,), box=Box(offsets=(2,), sizes=(3,))
        )
        with pytest.raises(RegistrationError) as e5:
            raw.request(DeclareSources(tensors=(bad_box,)))
        assert e5.value.code is ErrorCode.SHAPE_MISMATCH
    tr.close()
    # an engine's registration refused keeps no region at the daemon (each used to keep
    # one, mapped, of the size of what was refused, until the session ended)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job="dupes-engine")
    eng.register({"a": torch.zeros(4)})
    held = fetch(cluster.daemons[1].socket)["regions"]
    for bad, code in (
        ({"a": torch.zeros(4), "b": torch.zeros(1 << 20)}, ErrorCode.DUPLICATE),
        ({"c": torch.zeros(1 << 20, dtype=torch.complex64)}, ErrorCode.DTYPE_MISMATCH),
    ):
        with pytest.raises(RegistrationError) as e6:
            eng.register(bad)
        assert e6.value.code is code
    assert fetch(cluster.daemons[1].socket)["regions"] == held
    eng.close()


def test_versions_only_go_forwards(cluster: LocalCluster) -> None:
    tr, eng = pair(cluster, "versions")
    tr.publish(5)
    eng.wait(5)
    for bad in (5, 4):
        with pytest.raises(VersionError) as err:
            tr.publish(bad)
        assert "only go forwards" in err.value.message
    tr.publish(6)
    eng.wait(6)
    tr.close()
    eng.close()


def test_packing_that_fails_midway_aborts_the_version(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's packing raises (an injected fault, as a CUDA error would): publish
    raises it, the engine learns at once that the version was aborted and why, and the
    next version lands bitwise."""
    dst = torch.zeros(8, 8)
    tr, eng = pair(cluster, "packfail", w=dst)
    tr.publish(1)
    eng.wait(1)

    def failing(*_: object, **__: object) -> None:
        raise RuntimeError("no memory left to pack (injected)")

    monkeypatch.setattr(tr._packer, "pack_bucket", failing)
    with pytest.raises(RuntimeError, match="injected"):
        tr.publish(2)
    t0 = time.monotonic()
    with pytest.raises(WeightwireError) as err:
        eng.wait(2)
    assert time.monotonic() - t0 < 5
    assert err.value.code is ErrorCode.ABORTED
    assert "packing failed on trainer rank 0" in err.value.message
    monkeypatch.undo()
    tr.publish(3, {"w": W * 5})
    eng.wait(3)
    assert torch.equal(dst, W * 5)
    tr.close()
    eng.close()


def raw_socket(path: str) -> zmq.Socket:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"ipc://{path}")
    return s


def test_malformed_and_oversized_messages(cluster: LocalCluster) -> None:
    from weightwire.protocol.frames import Codec
    from weightwire.protocol.local import Error, LocalMessage

    codec = Codec(LocalMessage)
    s = raw_socket(cluster.daemons[0].socket)
    cases = [
        ([b"hello", b"\xc1\xc1"], "malformed", "undecodable"),
        ([b"only-one-frame"], "malformed", "expected [kind, header"),
        (
            [b"hello", msgspec.msgpack.encode({"type": "hello", "protocol": "one"})],
            "invalid",
            "protocol",
        ),
        (
            [b"get_plan", msgspec.msgpack.encode({"type": "get_plan"})],
            "no_session",
            "say hello first",
        ),
        (
            [b"ping", msgspec.msgpack.encode({"type": "ping"}), b"x" * (5 << 20)],
            "too_large",
            "exceeds",
        ),
        (
            [b"hello", msgspec.msgpack.encode({"type": "hello", "protocol": 99, "role": "admin"})],
            "unsupported_protocol",
            "99",
        ),
    ]
    for frames, code, needle in cases:
        s.send_multipart(frames)
        reply, _ = codec.decode(s.recv_multipart())
        assert isinstance(reply, Error), reply
        assert reply.code == code and needle in reply.message, (code, reply)
    # a request that fails validation is answered under its own req, so its caller hears
    s.send_multipart(
        [b"hello", msgspec.msgpack.encode({"type": "hello", "protocol": "x", "req": 77})]
    )
    reply, _ = codec.decode(s.recv_multipart())
    assert isinstance(reply, Error) and reply.req == 77
    s.close()
    assert fetch(cluster.daemons[0].socket)["node"] == "host0"
    healthy_sync(cluster, "after-garbage")


def test_small_bad_inputs_are_invalid_not_internal(cluster: LocalCluster) -> None:
    """Each of these once got `internal` or the wrong code: a NUL in a region path, trainer
    requests from an engine session, a bucket of a version never begun, an FP8 recipe with
    block 0, a source shape of 2^62 elements. Each is now refused as what it is."""
    sock = cluster.daemons[0].socket
    with DaemonConnection(sock) as eng:
        eng.request(Hello(protocol=PROTOCOL_VERSION, role="engine", rank=0, world_size=1, job="b"))
        with pytest.raises(RegistrationError) as e1:
            eng.request(RegisterRegion(path="/dev/shm/weightwire.1.x\0y", length=4096))
        assert e1.value.code is ErrorCode.INVALID and "NUL" in e1.value.message
        for msg in (
            BeginVersion(version=1, plan_hash="x"),
            BucketReady(version=1, bucket=0),
            AbortVersion(version=1, reason="x"),
            GetPlan(timeout_s=1),
        ):
            with pytest.raises(WeightwireError) as e2:
                eng.request(msg)
            assert e2.value.code is ErrorCode.INVALID, (msg, e2.value)
            assert "engine session" in e2.value.message
        q = Piece(source="w", box=Box.full((256, 256)), dst_offset=0, transform=Fp8BlockQuant(0))
        dest = DestTensor(name="w", dtype="float8_e4m3fn", shape=(256, 256), region=1, offset=0)
        with pytest.raises(WeightwireError) as e3:
            eng.request(DeclareDestinations(tensors=(msgspec.structs.replace(dest, pieces=(q,)),)))
        assert e3.value.code is ErrorCode.INVALID and "block" in e3.value.message
    with DaemonConnection(sock) as tr:
        tr.request(Hello(protocol=PROTOCOL_VERSION, role="trainer", rank=0, world_size=1, job="b"))
        with pytest.raises(WeightwireError) as e4:
            tr.request(BucketReady(version=3, bucket=0))
        assert e4.value.code is ErrorCode.INVALID and "never begun" in e4.value.message
        huge = {"name": "x", "dtype": "float32", "shape": [1 << 31] * 2}
        frames = [
            b"declare_sources",
            msgspec.msgpack.encode({"type": "declare_sources", "req": 5, "tensors": [huge]}),
        ]
        hello = {"type": "hello", "protocol": PROTOCOL_VERSION, "role": "trainer", "rank": 0}
        s = raw_socket(sock)
        s.send_multipart([b"hello", msgspec.msgpack.encode({**hello, "world_size": 1, "job": "c"})])
        s.recv_multipart()
        s.send_multipart(frames)
        reply, _ = Codec(LocalMessage).decode(s.recv_multipart())
        s.close()
        assert isinstance(reply, Error) and reply.req == 5, reply
        assert reply.code == "invalid" and "2^48" in reply.message, reply
    assert fetch(sock)["node"] == "host0"
    healthy_sync(cluster, "after-small-bad-inputs")


def test_wrong_typed_arguments_to_the_rank_calls_are_typed_errors(cluster: LocalCluster) -> None:
    """What a trainer script may hand the public calls by mistake: a list for a mapping, a
    numpy array or a sparse tensor for a tensor, a layout that is none, a float version, one
    too large for the protocol, a timeout of 0 or inf. Each is a typed error naming it, at
    once; these used to be AttributeErrors, msgspec's TypeError or OverflowError, a sparse
    tensor refused only by the first publish (an untyped RuntimeError), and `wait(v,
    timeout_s=0)` waited the whole default timeout. Integer scalars of numpy and torch are
    versions like any int, and the pair still syncs bitwise."""
    job = "wrong-types"
    tr = Trainer(np.int64(0), np.int64(1), socket=cluster.daemons[0].socket, job=job, timeout_s=10)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=10)
    try:
        registrations: list[tuple[Callable[[], object], str]] = [
            (lambda: tr.register([("w", W)]), "got a list"),  # type: ignore[arg-type]
            (lambda: tr.register({"w": W.numpy()}), "w is a numpy.ndarray"),  # type: ignore[dict-item]
            (lambda: tr.register({"w": W.to_sparse()}), "w is a torch.sparse_coo"),
            (lambda: tr.register({"w": W}, layout="rows"), "layout 'rows'"),  # type: ignore[arg-type]
            (lambda: eng.register([("w", W)]), "got a list"),  # type: ignore[arg-type]
            (lambda: eng.register({"w": W}, [("w", W)]), "sources is a list"),  # type: ignore[arg-type]
            (lambda: eng.register({"w": W}, {"w": "rows"}), "source 'rows'"),  # type: ignore[dict-item]
            (lambda: eng.register({"w": W.numpy()}), "w is a numpy.ndarray"),  # type: ignore[dict-item]
            (lambda: Engine(0.0, 1, socket=cluster.daemons[1].socket, job=job), "rank 0.0"),  # type: ignore[arg-type]
            (lambda: Trainer(0, 1, socket=cluster.daemons[0].socket, timeout_s=-1), "timeout_s"),
        ]
        for call, named in registrations:
            with pytest.raises(RegistrationError) as err:
                call()
            assert err.value.code is ErrorCode.INVALID and named in err.value.message, err.value
        with pytest.raises(RegistrationError) as rows:  # rows 6:10 of 8 were accepted
            eng.register({"w": W}, {"w": Rows((10, 8), 6, 14)})
        assert rows.value.code is ErrorCode.SHAPE_MISMATCH and "6:14" in rows.value.message
        dst = torch.zeros(8, 8)
        tr.register({"w": W.clone()})
        eng.register({"w": dst})
        for version in (2.0, "2", True, 1 << 64, -1):
            with pytest.raises(VersionError) as verr:
                tr.publish(version)  # type: ignore[arg-type]
            assert verr.value.code is ErrorCode.INVALID and repr(version) in str(verr.value)
        with pytest.raises(RegistrationError) as perr:
            tr.publish(1, tensors={"w": W.numpy()})  # type: ignore[dict-item]
        assert "w is a numpy.ndarray" in perr.value.message
        for timeout in (0, float("inf"), "1"):
            t0 = time.monotonic()
            with pytest.raises(RegistrationError) as terr:
                eng.wait(1, timeout_s=timeout)  # type: ignore[arg-type]
            assert "timeout_s" in terr.value.message and time.monotonic() - t0 < 2
        tr.publish(np.int64(1))  # type: ignore[arg-type]
        eng.wait(np.int64(1))  # type: ignore[arg-type]
        assert torch.equal(dst, W)
        tr.publish(torch.tensor(2), tensors={"w": W * 2})  # type: ignore[arg-type]
        eng.wait(2)
        assert torch.equal(dst, W * 2)
    finally:
        tr.close()
        eng.close()


def test_an_on_version_callback_that_raises_stops_nothing(cluster: LocalCluster) -> None:
    """A callback of the caller's that raises is logged; the other callbacks get every
    event, `latest` moves on, and a delta engine still applies and answers every version.
    It used to end the thread that delivers notifications: no later callback ran, and the
    delta engine never answered the next version, which timed out at the trainer with every
    byte landed ("did not land within")."""
    job = "raising-callback"
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=10)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=10, delta_area=0.5)
    seen: list[int] = []

    def broken(event: object) -> None:
        raise RuntimeError("a bug in the caller's callback")

    def record(event: object) -> None:
        assert not isinstance(event, Exception), event
        seen.append(event.version)  # type: ignore[attr-defined]

    try:
        dst = torch.zeros(8, 8)
        tr.register({"w": W.clone()})
        eng.register({"w": dst})
        eng.on_version(broken)
        eng.on_version(record)
        for version in (1, 2, 3):
            tr.publish(version, tensors={"w": W * version})
            eng.wait(version)
            assert torch.equal(dst, W * version)
        deadline = time.monotonic() + 10
        while seen != [1, 2, 3] and time.monotonic() < deadline:
            time.sleep(0.01)  # the notices come on their own thread
        assert seen == [1, 2, 3] and eng.latest is not None and eng.latest.version == 3
    finally:
        tr.close()
        eng.close()


def test_closing_a_rank_fails_the_calls_other_threads_wait_in(cluster: LocalCluster) -> None:
    """`close()` while another thread publishes (waiting for a plan, or mid-version) or
    waits for a version: those calls fail at once with a typed error naming the closed
    rank. They used to wait out their whole timeout (300 s by default) after close."""
    job = "closed-under-waits"
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=60)
    tr.register({"w": torch.ones(1 << 24)})  # 64 MiB: a version takes a while
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job + "-engine", timeout_s=60)
    outcomes: dict[str, BaseException | None] = {}

    def run(name: str, call: Callable[[], object]) -> threading.Thread:
        def body() -> None:
            try:
                call()
                outcomes[name] = None
            except BaseException as exc:
                outcomes[name] = exc

        th = threading.Thread(target=body)
        th.start()
        return th

    waiting = [run("publish without a plan", lambda: tr.publish(1))]
    waiting.append(run("wait", lambda: eng.wait(1)))
    time.sleep(0.5)
    tr.close()
    eng.close()
    for th in waiting:
        th.join(10)
        assert not th.is_alive(), f"a call still waits after close: {outcomes}"
    for name in ("publish without a plan", "wait"):
        err = outcomes[name]
        assert isinstance(err, WeightwireError) and "was closed" in err.message, (name, err)
    # mid-version: the publish ends (landed, or failed typed), and its staging outlives it
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job + "-2", timeout_s=60)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job + "-2", timeout_s=60)
    tr.register({"w": torch.ones(1 << 24)})
    eng.register({"w": torch.zeros(1 << 24)})
    tr.prepare()
    th = run("publish in flight", lambda: tr.publish(1))
    time.sleep(0.02)
    tr.close()
    th.join(10)
    assert not th.is_alive(), outcomes
    err = outcomes["publish in flight"]
    assert err is None or isinstance(err, WeightwireError), err
    eng.close()
    healthy_sync(cluster, "after-closed-under-waits")


def test_a_flood_of_waits_is_refused_past_a_cap_and_ends_with_its_session(
    cluster: LocalCluster,
) -> None:
    """A rank sends 1000 WaitVersion of a day each, pipelined. Each used to hold a task
    (~4 KB) for its whole timeout, after the rank left too: 100k of them grew the daemon
    by 390 MB. Now 64 may wait per connection, the rest get `busy` at once, and the waits
    end with the session."""
    from weightwire.daemon.pending import MAX_WAITING

    sock = cluster.daemons[0].socket
    before = fetch(sock)["requests_waiting"]
    codec = Codec(LocalMessage)
    s = raw_socket(sock)
    hello = Hello(protocol=PROTOCOL_VERSION, role="engine", rank=0, world_size=1, job="flood")
    s.send_multipart(codec.encode(hello))
    s.recv_multipart()
    n = 1000
    for req in range(1, n + 1):
        s.send_multipart(codec.encode(WaitVersion(req=req, version=7, timeout_s=86400)))
    s.send_multipart(codec.encode(StatusRequest(req=n + 1)))
    busy: list[int] = []
    while True:
        reply, _ = codec.decode(s.recv_multipart())
        if isinstance(reply, StatusReply):
            break
        assert isinstance(reply, Error) and reply.code == "busy", reply
        assert f"at most {MAX_WAITING}" in reply.message, reply
        busy.append(reply.req)
    assert busy == list(range(MAX_WAITING + 1, n + 1))
    assert reply.body["requests_waiting"] == before + MAX_WAITING
    s.send_multipart(codec.encode(Goodbye()))
    s.close()
    deadline = time.monotonic() + 10
    while fetch(sock)["requests_waiting"] != before:
        assert time.monotonic() < deadline, fetch(sock)["requests_waiting"]
        time.sleep(0.05)
    healthy_sync(cluster, "after-flood")


def test_a_flood_of_hellos_and_bucket_readies_is_answered_typed_and_flat(
    cluster: LocalCluster,
) -> None:
    """One connection sends 20k BucketReady of a version it never began, 2k more hellos,
    and 500 connections each say hello once and leave without goodbye. Every one is
    answered with a typed error or a welcome, the daemon's RSS stays flat (< 32 MiB more),
    it logs no line per message, and the sessions left behind are released."""
    d = cluster.daemons[0]
    codec = Codec(LocalMessage)

    def rss() -> int:
        with open(f"/proc/{d.proc.pid}/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) << 10

    before, lines = rss(), len(d.log_path.read_text().splitlines())
    s = raw_socket(d.socket)
    hello = Hello(protocol=PROTOCOL_VERSION, role="trainer", rank=0, world_size=1, job="hflood")
    s.send_multipart(codec.encode(hello))
    s.recv_multipart()
    n_ready, n_hello = 20000, 2000
    for i in range(n_ready):
        s.send_multipart(codec.encode(BucketReady(version=3, bucket=i % 7)))
    for i in range(n_hello):
        s.send_multipart(codec.encode(msgspec.structs.replace(hello, req=i + 1)))
    s.send_multipart(codec.encode(Ping(req=10**6)))
    codes: dict[str, int] = {}
    while True:
        reply, _ = codec.decode(s.recv_multipart())
        if reply.req == 10**6:
            break
        assert isinstance(reply, Error), reply
        codes[reply.code] = codes.get(reply.code, 0) + 1
    assert codes == {"invalid": n_ready, "duplicate": n_hello}, codes
    s.close()
    others = []
    for i in range(500):
        o = raw_socket(d.socket)
        o.send_multipart(codec.encode(msgspec.structs.replace(hello, rank=0, job=f"hf{i}")))
        others.append(o)
    for o in others:
        welcome, _ = codec.decode(o.recv_multipart())
        assert type(welcome).__name__ == "Welcome", welcome
        o.close()
    assert rss() - before < 32 << 20, (before, rss())
    deadline = time.monotonic() + 3 + 10  # FAST: session-timeout-s 3
    while any(r["job"].startswith("hf") for r in fetch(d.socket)["sessions"]):
        assert time.monotonic() < deadline, "sessions of gone connections kept"
        time.sleep(0.2)
    # a line per rank that connected and left is fine; none per refused message
    assert len(d.log_path.read_text().splitlines()) - lines < 3 * 500 + 50
    healthy_sync(cluster, "after-hello-flood")


def test_oversized_messages_get_a_too_large_error_and_a_throttled_log_line(
    cluster: LocalCluster,
) -> None:
    """Messages far over max_message_bytes (4 MiB here) were cut off by ZeroMQ: no reply,
    no log line. Now each is answered, and the log says so once per interval."""
    d = cluster.daemons[0]
    s = raw_socket(d.socket)
    codec = Codec(LocalMessage)
    big = b"x" * (20 << 20)

    def bad_lines() -> list[dict[str, object]]:
        return [r for r in d.logs() if r.get("event") == "bad local message"]

    time.sleep(5.2)  # past the interval of any earlier bad message's line
    before = len(bad_lines())
    for i in range(5):
        s.send_multipart([b"ping", msgspec.msgpack.encode({"type": "ping", "req": i + 1}), big])
        reply, _ = codec.decode(s.recv_multipart())
        assert isinstance(reply, Error) and reply.req == i + 1, reply
        assert reply.code == "too_large" and "exceeds the limit of 4194304" in reply.message, reply
    lines = bad_lines()
    assert len(lines) == before + 1 and lines[-1]["code"] == "too_large", lines[before:]
    time.sleep(5.2)
    s.send_multipart([b"ping", msgspec.msgpack.encode({"type": "ping", "req": 9}), big])
    reply, _ = codec.decode(s.recv_multipart())
    assert isinstance(reply, Error) and reply.code == "too_large"
    s.close()
    lines = bad_lines()
    assert len(lines) == before + 2 and lines[-1].get("suppressed") == 4, lines[before:]
    # the client library knows the limit from Welcome and refuses before sending
    with DaemonConnection(d.socket) as c:
        c.request(Hello(protocol=PROTOCOL_VERSION, role="trainer", rank=0, world_size=1, job="o"))
        many = tuple(
            SourceTensor(name=f"{i:04d}" + "n" * 1000, dtype="float32", shape=(4,))
            for i in range(5000)
        )
        with pytest.raises(ProtocolError) as err:
            c.request(DeclareSources(tensors=many))
        assert err.value.code is ErrorCode.TOO_LARGE and "4194304" in err.value.message
        c.request(Ping())
    healthy_sync(cluster, "after-oversized")


def test_oversized_peer_messages_are_logged() -> None:
    """An authenticated peer's message far over max_message_bytes was cut off by ZeroMQ
    without a trace; now it is refused with a log line (once per interval)."""
    from .conftest import FAST, NETNS

    c = LocalCluster(hosts=1, use_netns=NETNS, extra=FAST)
    c.keys("probe")  # a peer the daemon trusts, with a name of its own
    c.start()
    try:
        d = c.daemons[0]
        sender = subprocess.run(
            [*c.prefix(0), sys.executable, "-c", OVERSIZED_PEER, d.endpoint,
             str(c.workdir / "keys" / "probe" / "probe.key_secret"), c.coordinator_key()],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert sender.returncode == 0, sender.stderr
        deadline = time.monotonic() + 10
        lines: list[dict[str, object]] = []
        while not lines and time.monotonic() < deadline:
            time.sleep(0.1)
            lines = [
                r
                for r in d.logs()
                if r.get("event") == "bad peer message" and r.get("code") == "too_large"
            ]
        assert lines and "exceeds the limit of 4194304" in str(lines[-1]["error"]), d.log_path
        assert lines[-1]["peer"] == "probe"
        assert fetch(d.socket)["node"] == "host0"
    finally:
        assert c.stop() == [0]


OVERSIZED_PEER = """
import sys, time, zmq, zmq.auth
endpoint, secret_file, server_key = sys.argv[1:4]
public, secret = zmq.auth.load_certificate(secret_file)
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 2000)
s.setsockopt(zmq.IDENTITY, b"probe")
s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server_key.encode()
s.connect(endpoint)
s.send_multipart([b"heartbeat", b"\\x80", b"x" * (20 << 20)])
time.sleep(1.0)
s.close()
"""


def test_a_flood_of_unasked_applied_answers_logs_a_line_a_while(cluster: LocalCluster) -> None:
    """An engine rank's session sends 5000 `Applied` for versions its daemon never asked it
    to apply (no reply exists for them): each was one warning line; now one per interval,
    and the daemon serves on."""
    tr, eng = pair(cluster, "applied-flood")
    try:
        tr.publish(1)
        eng.wait(1)
        d = cluster.daemons[1]
        lines = len(d.log_path.read_text().splitlines())
        for version in range(5000):
            eng._conn.send(local_msgs.Applied(rank=0, version=version, ok=True))
        eng._conn.request(Ping())  # after every Applied: each was handled
        stray = [
            line
            for line in d.log_path.read_text().splitlines()[lines:]
            if "applied for a version not being applied" in line
        ]
        assert 1 <= len(stray) <= 3, len(stray)
    finally:
        tr.close()
        eng.close()
    healthy_sync(cluster, "after-applied-flood")


def test_a_world_too_large_to_list_is_refused_and_the_coordinator_serves_on(
    cluster: LocalCluster,
) -> None:
    """A trainer rank saying hello with a world of 2^40 ranks, on the host that does not
    coordinate: once it declared a tensor, the coordinator listed the 2^40 - 1 ranks still
    missing and answered nothing again (its status and every rank timed out, SIGKILL to
    stop it). A world is at most 2^16 ranks: the hello is refused, naming the field; a
    world of 2^16 that lacks all but one rank is named briefly, and a job syncs bitwise."""
    with pytest.raises(WeightwireError) as err:
        Trainer(0, 1 << 40, socket=cluster.daemons[1].socket, job="huge-world", timeout_s=5)
    assert err.value.code is ErrorCode.INVALID and "world_size" in err.value.message
    tr = Trainer(0, 1 << 16, socket=cluster.daemons[1].socket, job="wide-world", timeout_s=5)
    try:
        tr.register({"w": torch.zeros(4)})
        with pytest.raises(PlanError):
            tr.prepare(timeout_s=2)
        t0 = time.monotonic()
        jobs = fetch(cluster.daemons[0].socket)["coordination"]["jobs"]
        assert time.monotonic() - t0 < 5
        missing = jobs["wide-world"]["missing"]
        assert missing and "(65535 ranks)" in missing[0] and len(str(missing)) < 1000, missing
    finally:
        tr.close()
    healthy_sync(cluster, "after-huge-world")
