"""Every control message round-trips; everything else is refused with a typed error."""

from __future__ import annotations

import msgspec
import pytest

from weightwire.protocol import PROTOCOL_VERSION, check_protocol
from weightwire.protocol import local as L
from weightwire.protocol import peer as P
from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    ProtocolError,
    RegionError,
    VersionError,
    error_from_code,
    retryable,
)
from weightwire.protocol.frames import Codec
from weightwire.protocol.plan import (
    Bucket,
    Expect,
    NodePlan,
    PackOp,
    RankPlan,
    WriteOp,
    decode_imm,
    encode_imm,
)
from weightwire.protocol.regions import (
    RegionDescriptor,
    RegionKeys,
    TcpEndpoint,
    TcpKey,
    TransportEndpoints,
    VerbsKey,
)
from weightwire.protocol.tensors import (
    Box,
    Cast,
    DestTensor,
    Fp8BlockQuant,
    Piece,
    SourceTensor,
)

BOX = Box(offsets=(0, 4), sizes=(8, 4))
SRC = SourceTensor(name="w", dtype="bfloat16", shape=(8, 8), box=BOX)
DST = DestTensor(
    name="w",
    dtype="float8_e4m3fn",
    shape=(8, 4),
    region=3,
    offset=256,
    pieces=(Piece(source="w", box=BOX, dst_offset=0, transform=Fp8BlockQuant()),),
)
REGION = RegionDescriptor(
    id=3,
    node="n1",
    kind="cpu",
    length=1 << 20,
    keys=RegionKeys(
        tcp=TcpKey(rkey=2**64 - 1), verbs=(VerbsKey(device="mlx5_0", addr=2**47, rkey=7),)
    ),
)
RANK_PLAN = RankPlan(
    plan_hash="abc",
    rank=1,
    staging_bytes=4096,
    buckets=(
        Bucket(
            index=0,
            packs=(
                PackOp(
                    source="w",
                    box=BOX,
                    transform=Cast(dtype="float16"),
                    staging_offset=0,
                    nbytes=64,
                ),
            ),
            writes=(
                WriteOp(src_offset=0, length=64, dst_node="n1", dst_region=3, dst_offset=0, slot=2),
            ),
            nbytes=64,
        ),
    ),
    regions=(REGION,),
)

LOCAL_SAMPLES = [
    L.Hello(protocol=PROTOCOL_VERSION, role="trainer", rank=1, world_size=4, job="j", pid=9, req=1),
    L.Welcome(protocol=1, node="n", session="s", req=1),
    L.RegisterRegion(path="/dev/shm/x", length=10, purpose="staging", req=2),
    L.RegionRegistered(region=5, req=2),
    L.RemapRegion(
        region=5,
        cuda=L.CudaRegion(device_uuid="GPU-u", ipc_handle=b"", vmm_token=b"t" * 16, vmm_sizes=(2,)),
        req=2,
    ),
    L.DeclareSources(tensors=(SRC,), req=3),
    L.DeclareDestinations(tensors=(DST,), layout=L.EngineLayout(family="qwen3", tp_size=2), req=4),
    L.Ok(req=5, detail="x"),
    L.Error(code="invalid", message="m", req=6),
    L.GetPlan(timeout_s=3.0, req=7),
    L.PlanReply(plan=RANK_PLAN, req=7),
    L.BeginVersion(version=2**40, plan_hash="abc", req=8),
    L.BucketReady(version=3, bucket=1),
    L.BucketsLanded(version=3, buckets=(0, 2)),
    L.BeginVersion(version=4, plan_hash="abc", staging_buckets=2, slot_events=True, req=8),
    L.BucketsIssued(version=3, buckets=(1,), events=(bytes(range(64)), b"\x00" * 64)),
    L.BucketReady(version=3, bucket=1, more=(2,), delta=((1, 0, 4096), (2, 1, 128))),
    L.TrailersReady(version=3, lengths=(104, 144)),
    L.ApplyVersion(rank=1, version=3, region=7, trailers=((0, 104), (128, 144))),
    L.ApplyBucket(
        rank=1,
        version=3,
        region=7,
        sender=2,
        bucket=5,
        ranges=((4, 0, 64, 2, 128),),
        payloads=((256, 96),),
    ),
    L.Applied(rank=1, version=3, ok=False, code="checksum", message="mismatch"),
    L.AbortVersion(version=3, reason="r", req=9),
    L.PublishResult(version=3, ok=False, code="peer_lost", message="gone"),
    L.PublishResult(
        version=3,
        ok=True,
        verdicts=(L.Verdict(node="e", slot=0, rank=1, ok=True),),
        delta_bytes=4200,
    ),
    L.WaitVersion(version=3, timeout_s=1.0, req=10),
    L.VersionComplete(rank=0, version=3, nbytes=10, seconds=0.5),
    L.VersionFailed(rank=0, version=3, code="timeout", message="late"),
    L.StatusRequest(req=11),
    L.StatusRequest(req=12, cluster=True),
    L.StatusReply(body={"node": "n", "list": [1, 2]}, req=11),
    L.Ping(req=12),
    L.Pong(session="s", req=12),
    L.Goodbye(),
]

PEER_SAMPLES = [
    P.PeerHello(
        protocol=1,
        member=P.Member(
            node="n",
            endpoint="tcp://1.2.3.4:5",
            incarnation="i",
            transports=TransportEndpoints(tcp=TcpEndpoint(host="1.2.3.4", port=9)),
        ),
    ),
    P.PeerWelcome(protocol=1, coordinator="c"),
    P.Advertise(
        node="n",
        incarnation="i",
        job="j",
        ranks=(
            P.RankAdvert(role="trainer", rank=0, world_size=1, sources=(SRC,)),
            P.RankAdvert(
                role="engine", rank=0, world_size=1, destinations=(DST,), regions=(REGION,)
            ),
        ),
        seq=3,
    ),
    P.Membership(members=(), lost=("x",)),
    P.AssignPlan(
        plan=NodePlan(
            plan_hash="abc",
            job="j",
            sends=(RANK_PLAN,),
            expects=(Expect(rank=0, slot=1, count=3, nbytes=9, sources=("n",)),),
        )
    ),
    P.PlanProblem(job="j", code="plan", message="no"),
    P.Heartbeat(node="n", incarnation="i", seq=1),
    P.VersionStart(job="j", version=1, source_node="n", source_rank=0),
    P.VersionAbort(job="j", version=1, source_node="n", source_rank=0, code="aborted", message="m"),
    P.VersionVerdict(
        job="j",
        version=1,
        verdict=L.Verdict(node="e", slot=0, rank=0, ok=False, code="checksum", message="m"),
    ),
    P.BucketLanded(
        job="j",
        version=1,
        source_node="n",
        source_rank=0,
        bucket=3,
        parts=(P.LandedPart(slot=2, ranges=((4, 0, 64, 1, 0),), payloads=((0, 80),)),),
    ),
    P.TransportSignal(transport="verbs", node="n", payload=b"\x00\x01", reply=True, req=4),
    P.PeerError(code="invalid", message="m"),
    P.StatusQuery(req=5),
    P.StatusAnswer(body={"node": "n", "peers": [1]}, req=5),
]


@pytest.mark.parametrize("msg", LOCAL_SAMPLES, ids=lambda m: type(m).__name__)
def test_local_messages_round_trip(msg: msgspec.Struct) -> None:
    codec = Codec(L.LocalMessage)
    frames = codec.encode(msg, b"raw")
    decoded, buffers = codec.decode(frames)
    assert decoded == msg and [bytes(b) for b in buffers] == [b"raw"]


@pytest.mark.parametrize("msg", PEER_SAMPLES, ids=lambda m: type(m).__name__)
def test_peer_messages_round_trip(msg: msgspec.Struct) -> None:
    codec = Codec(P.PeerMessage)
    decoded, _ = codec.decode(codec.encode(msg))
    assert decoded == msg


def test_every_union_member_has_a_sample() -> None:
    local_types = set(L.LocalMessage.__args__)  # type: ignore[attr-defined]
    peer_types = set(P.PeerMessage.__args__)  # type: ignore[attr-defined]
    assert local_types == {type(m) for m in LOCAL_SAMPLES}
    assert peer_types == {type(m) for m in PEER_SAMPLES}


def _rejects(codec: Codec, frames: list[bytes], code: ErrorCode, needle: str) -> None:
    with pytest.raises(ProtocolError) as err:
        codec.decode(frames)
    assert err.value.code is code, err.value
    assert needle in err.value.message, err.value.message


def test_rejections_name_the_problem() -> None:
    codec = Codec(L.LocalMessage, max_bytes=1024)
    enc = msgspec.msgpack.encode
    _rejects(codec, [b"hello"], ErrorCode.MALFORMED, "expected [kind, header")
    _rejects(codec, [b"hello", b"\xc1garbage"], ErrorCode.MALFORMED, "undecodable")
    _rejects(codec, [b"hello", enc({"type": "nope"})], ErrorCode.INVALID, "nope")
    _rejects(
        codec, [b"hello", enc({"type": "hello", "role": "trainer"})], ErrorCode.INVALID, "protocol"
    )
    bad_rank = {"type": "hello", "protocol": 1, "role": "trainer", "rank": -1}
    _rejects(codec, [b"hello", enc(bad_rank)], ErrorCode.INVALID, "rank")
    bad_role = {"type": "hello", "protocol": 1, "role": "root"}
    _rejects(codec, [b"hello", enc(bad_role)], ErrorCode.INVALID, "role")
    ok = {"type": "ping"}
    _rejects(codec, [b"hello", enc(ok)], ErrorCode.MALFORMED, "does not match")
    _rejects(codec, [b"ping", enc(ok), b"x" * 2000], ErrorCode.TOO_LARGE, "exceeds")
    bad_dtype = {
        "type": "declare_sources",
        "tensors": [{"name": "w", "dtype": "int4", "shape": [1]}],
    }
    _rejects(codec, [b"declare_sources", enc(bad_dtype)], ErrorCode.INVALID, "dtype")


def test_fields_only_grow() -> None:
    """A newer peer's extra fields are ignored; an older peer's missing ones take defaults."""
    codec = Codec(L.LocalMessage)
    newer = msgspec.msgpack.encode(
        {"type": "hello", "protocol": 1, "role": "engine", "future_field": [1, 2]}
    )
    msg, _ = codec.decode([b"hello", newer])
    assert msg == L.Hello(protocol=1, role="engine")
    assert msg.job == "default" and msg.world_size == 1


def test_protocol_version_check() -> None:
    check_protocol(PROTOCOL_VERSION, "peer")
    with pytest.raises(ProtocolError) as err:
        check_protocol(PROTOCOL_VERSION + 1, "peer x")
    assert err.value.code is ErrorCode.UNSUPPORTED_PROTOCOL and "peer x" in str(err.value)


def test_immediates_carry_version_and_slot() -> None:
    for version, slot in [(0, 0), (1, 65535), (70000, 3), (2**40 + 5, 12)]:
        assert decode_imm(encode_imm(version, slot)) == (version & 0xFFFF, slot)
        assert 0 <= encode_imm(version, slot) < 2**32


def test_error_codes_become_typed_exceptions() -> None:
    assert isinstance(error_from_code("peer_lost", "x"), PeerLostError)
    assert isinstance(error_from_code("out_of_bounds", "x"), RegionError)
    assert isinstance(error_from_code("version_backwards", "x"), VersionError)
    unknown = error_from_code("from_the_future", "x")
    assert "from_the_future" in str(unknown)
    assert isinstance(error_from_code("no_space", "x"), RegionError)


def test_what_a_caller_retries() -> None:
    """Failures that pass (a lost or hung peer, a failed or aborted write, a timeout, a
    plan being remade) are retryable; bad input and impossible plans are not."""
    for code in ("peer_lost", "transfer", "aborted", "timeout", "plan_changed", "not_ready"):
        assert retryable(error_from_code(code, "x")), code
    for code in ("invalid", "plan", "version_backwards", "no_space", "out_of_bounds", "internal"):
        assert not retryable(error_from_code(code, "x")), code
    assert not retryable(RuntimeError("x"))


def test_tensor_sizes_and_fp8_blocks_are_checked_on_decode() -> None:
    codec = Codec(L.LocalMessage)
    enc = msgspec.msgpack.encode
    huge = {"name": "w", "dtype": "float32", "shape": [1 << 31, 1 << 31]}
    _rejects(
        codec,
        [b"declare_sources", enc({"type": "declare_sources", "tensors": [huge]})],
        ErrorCode.INVALID,
        "2^48",
    )
    for transform in ({"type": "fp8_quant", "block": 0}, {"type": "fp8_scale", "block": -1}):
        piece = {"source": "w", "box": {"offsets": [0], "sizes": [4]}, "dst_offset": 0}
        dest = {
            "name": "w",
            "dtype": "float32",
            "shape": [4],
            "region": 1,
            "offset": 0,
            "pieces": [{**piece, "transform": transform}],
        }
        msg = {"type": "declare_destinations", "tensors": [dest]}
        _rejects(codec, [b"declare_destinations", enc(msg)], ErrorCode.INVALID, "block")


def test_strided_writes_are_checked_on_decode() -> None:
    base = {
        "src_offset": 0,
        "length": 64,
        "dst_node": "n",
        "dst_region": 1,
        "dst_offset": 0,
        "slot": 0,
    }
    enc = msgspec.msgpack.encode
    older = msgspec.msgpack.decode(enc(base), type=WriteOp)  # a peer without strided writes
    assert (older.count, older.nbytes, older.blocks()) == (1, 64, [(0, 0)])
    ok = msgspec.msgpack.decode(
        enc({**base, "count": 3, "src_stride": 64, "dst_stride": 100}), type=WriteOp
    )
    assert ok.nbytes == 192 and ok.blocks() == [(0, 0), (64, 100), (128, 200)]
    for bad, why in [
        ({"count": 3, "src_stride": 64, "dst_stride": 63}, "overlap"),
        ({"count": 0}, "count"),
    ]:
        with pytest.raises(msgspec.ValidationError, match=why):
            msgspec.msgpack.decode(enc({**base, **bad}), type=WriteOp)
