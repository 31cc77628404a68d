"""Peers are CURVE-authenticated: an unknown key is refused and logged, plaintext is refused,
and plaintext mode exists only behind an explicit setting that warns."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

from weightwire.client.status import fetch
from weightwire.daemon.security import keygen
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.frames import Codec
from weightwire.protocol.peer import Member, PeerHello, PeerMessage

from .conftest import FAST


def start_coordinator(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A coordinator daemon run as a process with `flags` (socket and peer port of its own
    in `tmp_path`), to its exit: its output, for the startup errors it names."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "weightwire.daemon",
            "--is-coordinator",
            "--local-socket",
            str(tmp_path / "s.sock"),
            "--peer-bind",
            "tcp://127.0.0.1:0",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


def members(cluster: LocalCluster) -> set[str]:
    coord = fetch(cluster.daemons[0].socket).get("coordination") or {}
    return set(coord.get("members", []))


def test_unknown_key_and_plaintext_peers_are_refused(cluster: LocalCluster) -> None:
    rogue_dir = cluster.workdir / "rogue"
    _, secret = keygen(str(rogue_dir), "rogue")
    rogue = cluster.start_daemon(
        1,
        node="rogue",
        coordinator_endpoint=cluster.daemons[0].endpoint,
        flags={
            "curve-secret-key-file": str(secret),
            "curve-allowed-keys-dir": str(cluster.workdir / "keys" / "public"),
            "coordinator-public-key": cluster.coordinator_key(),
        },
    )
    # a plaintext DEALER speaking the protocol perfectly
    ctx = zmq.Context.instance()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.IDENTITY, b"plaintext")
    plain.connect(cluster.daemons[0].endpoint)
    hello = PeerHello(
        protocol=PROTOCOL_VERSION,
        member=Member(node="plaintext", endpoint="tcp://127.0.0.1:1", incarnation="x"),
    )
    plain.send_multipart(Codec(PeerMessage).encode(hello), flags=zmq.NOBLOCK)
    time.sleep(3)
    assert members(cluster) == {"host0", "host1"}, "a peer with an unknown or no key joined"
    assert fetch(rogue.socket)["coordinator"] is None
    refusals = [
        e for e in cluster.daemons[0].logs() if e.get("event") == "peer refused: unknown CURVE key"
    ]
    assert refusals, "the refusal of the unknown key was not logged"
    plain.close()
    rogue.proc.terminate()
    assert rogue.proc.wait(15) == 0
    cluster.daemons.remove(rogue)


def test_plaintext_only_when_asked_and_it_warns() -> None:
    c = LocalCluster(hosts=2, insecure=True, extra=FAST)
    try:
        c.start()
        c.wait_joined()
        warnings = [
            e
            for e in c.daemons[0].logs()
            if "PLAINTEXT" in str(e.get("event")) and e.get("level") == "warning"
        ]
        assert warnings
    finally:
        assert c.stop() == [0, 0]


def test_no_keys_and_not_insecure_is_a_clear_startup_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = start_coordinator(tmp_path)
    assert out.returncode == 1
    assert "weightwire keygen" in out.stdout and "insecure = true" in out.stdout


def test_keys_starting_with_a_dash_reach_the_daemon_intact() -> None:
    """Z85 keys may begin with '-': the local cluster passes flags as --key=value, which
    argparse never mistakes for a flag (a CI run once failed on such a key)."""
    import argparse

    from weightwire.daemon.flags import add_flags
    from weightwire.harness.localcluster import daemon_argv

    parser = argparse.ArgumentParser()
    add_flags(parser)
    key = "-" + "a" * 39
    ns = parser.parse_args(daemon_argv({"coordinator-public-key": key, "is-coordinator": ""}))
    assert ns.coordinator_public_key == key and ns.is_coordinator is True


def test_a_missing_secret_key_file_is_named_with_how_to_make_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "gpu-7.key_secret"
    out = start_coordinator(tmp_path, "--curve-secret-key-file", str(missing))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"no such file: {missing}" in out.stdout, out.stdout + out.stderr
    assert f"weightwire keygen --dir {tmp_path} --name gpu-7" in out.stdout
    assert "curve_secret_key_file" in out.stdout and "Invalid certificate" not in out.stdout


def test_a_missing_trusted_keys_directory_is_a_startup_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Without the directory no peer would ever be trusted, silently: refuse to start."""
    subprocess.run(
        [sys.executable, "-m", "weightwire.cli", "keygen", "--dir", str(tmp_path), "--name", "n"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    missing = tmp_path / "peers.d"
    out = start_coordinator(
        tmp_path,
        "--curve-secret-key-file",
        str(tmp_path / "n.key_secret"),
        "--curve-allowed-keys-dir",
        str(missing),
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"curve_allowed_keys_dir: no such directory: {missing}" in out.stdout, (
        out.stdout + out.stderr
    )
