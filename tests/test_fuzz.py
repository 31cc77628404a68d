"""Fuzzing: control-message decoders and the tcp frame parser, and a live daemon.

hypothesis runs in every test run; atheris (libFuzzer) adds 100k inputs per target in a
bounded run when it is installed (it says so when it is not).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.transport.tcp.data import PREFIX

from .fuzz.targets import RKEY, frame_parser, local_decoder, peer_decoder, seeds
from .test_bad_inputs import healthy_sync

ROOT = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))

frames = st.lists(st.binary(max_size=64), min_size=0, max_size=4).map(b"\xff\xfe".join)
msgpack_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=12,
)


@FAST
@given(st.one_of(frames, st.sampled_from(seeds())))
def test_local_decoder_never_crashes(data: bytes) -> None:
    local_decoder(data)


@FAST
@given(frames)
def test_peer_decoder_never_crashes(data: bytes) -> None:
    peer_decoder(data)


@FAST
@given(
    st.sampled_from(
        [
            "hello",
            "get_plan",
            "declare_sources",
            "bucket_ready",
            "wait_version",
            "register_region",
            "status",
            "advertise",
            "assign_plan",
            "heartbeat",
        ]
    ),
    st.dictionaries(st.text(max_size=12), msgpack_like, max_size=6),
)
def test_typed_messages_with_random_fields(kind: str, fields: dict) -> None:
    import msgspec

    body = msgspec.msgpack.encode({**fields, "type": kind})
    local_decoder(kind.encode() + b"\xff\xfe" + body)
    peer_decoder(kind.encode() + b"\xff\xfe" + body)


@st.composite
def frame_streams(draw: st.DrawFn) -> bytes:
    """Mostly well-formed streams (hello, writes near the region's edges), some corrupted."""
    from weightwire.transport.tcp import wire
    from weightwire.transport.tcp.data import DataHello, Write

    out = [bytes([draw(st.integers(0, 255))]), wire.encode(DataHello(protocol=1, node="p"))]
    for _ in range(draw(st.integers(0, 6))):
        off = draw(st.integers(0, 4200))
        n = draw(st.integers(0, 300))
        key = draw(st.sampled_from([RKEY, RKEY, 8, 2**64 - 1]))
        region = draw(st.sampled_from([1, 1, 2]))
        out.append(wire.encode(Write(seq=1, region=region, rkey=key, offset=off, length=n)))
        out.append(draw(st.binary(min_size=n, max_size=n)))
    data = b"".join(out)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.binary(max_size=16)) + data[cut:]
    return data


@FAST
@given(st.one_of(frame_streams(), st.binary(max_size=512)))
def test_frame_parser_never_writes_outside_a_region(data: bytes) -> None:
    frame_parser(data)


def test_frame_parser_huge_declared_length_is_refused_without_allocating() -> None:
    frame_parser(b"\x05" + PREFIX.pack(2, 0xFFFFFFFF))


@pytest.mark.parametrize("target", ["local", "peer", "frames"])
def test_atheris_100k_inputs(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed (hypothesis still ran)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, s in enumerate(seeds()):
        (corpus / f"seed{i}").write_bytes(s)
    runs = int(os.environ.get("WEIGHTWIRE_FUZZ_RUNS", "100000"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.run_atheris",
            target,
            str(corpus),
            f"-runs={runs}",
            "-max_total_time=240",
            "-max_len=2048",
            "-print_final_stats=1",
            # Linux carries ru_maxrss across execve: the child starts with pytest's peak,
            # which libFuzzer would take for its own; the timeout bounds the run instead
            "-rss_limit_mb=0",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    done = [
        int(line.rsplit(":", 1)[1])
        for line in out.stderr.splitlines()
        if line.startswith("stat::number_of_executed_units")
    ]
    assert done and done[0] >= min(runs, 100000), out.stderr[-2000:]


def test_live_daemon_survives_garbage_and_keeps_serving(cluster: LocalCluster) -> None:
    rng = random.Random(7)
    ctx = zmq.Context.instance()
    local = ctx.socket(zmq.DEALER)
    local.setsockopt(zmq.LINGER, 0)
    local.connect(f"ipc://{cluster.daemons[0].socket}")
    peer = ctx.socket(zmq.DEALER)  # plaintext: CURVE refuses it before any decoding
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(cluster.daemons[0].endpoint)
    pool = seeds()
    for i in range(2000):
        base = bytearray(rng.choice(pool))
        for _ in range(rng.randint(0, 8)):
            if base:
                base[rng.randrange(len(base))] = rng.randrange(256)
        parts = bytes(base).split(b"\xff\xfe") or [b""]
        (local if i % 2 else peer).send_multipart(parts, flags=zmq.NOBLOCK)
    local.close()
    peer.close()
    assert fetch(cluster.daemons[0].socket)["node"] == "host0"
    healthy_sync(cluster, "after-fuzz")
