"""Which address a node advertises to its peers: never a loopback address it was not told to
use, and a host name that does not resolve is a config error naming advertise_host.

The host names are real ones, resolved for real (`localhost` is loopback everywhere, the
`.invalid` top-level domain never resolves, RFC 6761); only gethostname() is swapped, or,
for the daemon itself, the host name of a UTS namespace is set. And how many tcp streams
a node opens per peer by default."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from weightwire.daemon.config import ConfigError, DaemonConfig
from weightwire.protocol.errors import ErrorCode, retryable

UNRESOLVABLE = "ww-no-such-host.invalid"


def _cfg(**kw: object) -> DaemonConfig:
    return DaemonConfig(is_coordinator=True, **kw)  # type: ignore[arg-type]


def test_wildcard_bind_with_a_loopback_host_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(ConfigError) as err:
        _cfg(peer_bind="tcp://0.0.0.0:7470").resolved()
    assert err.value.code is ErrorCode.INVALID and not retryable(err.value)
    msg = err.value.message
    assert "'localhost'" in msg and "127.0.0.1" in msg and "loopback" in msg
    assert "set advertise_host" in msg and "tcp://0.0.0.0:7470" in msg


def test_unresolvable_host_name_names_it_and_advertise_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: UNRESOLVABLE)
    for bind in ("tcp://0.0.0.0:7470", "tcp://*:7470"):
        with pytest.raises(ConfigError) as err:
            _cfg(peer_bind=bind).resolved()
        assert UNRESOLVABLE in err.value.message and "set advertise_host" in err.value.message


@pytest.mark.parametrize("name", ["localhost", UNRESOLVABLE])
def test_explicit_advertise_host_is_taken_as_it_is(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: name)
    for advertise in ("10.0.0.17", "127.0.0.1", "::1"):
        cfg = _cfg(peer_bind="tcp://0.0.0.0:7470", advertise_host=advertise).resolved()
        assert cfg.advertise_host == advertise


def test_explicit_loopback_bind_is_advertised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests and single-host setups bind loopback explicitly: that is what peers get."""
    monkeypatch.setattr(socket, "gethostname", lambda: UNRESOLVABLE)
    assert _cfg(peer_bind="tcp://127.0.0.1:0").resolved().advertise_host == "127.0.0.1"
    assert _cfg(peer_bind="tcp://[::1]:0").resolved().advertise_host == "::1"


def test_wildcard_bind_with_a_routable_host_name_advertises_its_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "192.0.2.7")  # resolves to itself
    assert _cfg(peer_bind="tcp://0.0.0.0:7470").resolved().advertise_host == "192.0.2.7"


def _daemon_in_uts(hostname: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """weightwired, binding the wildcard, in a UTS namespace whose host name is `hostname`."""
    argv = [
        sys.executable, "-m", "weightwire.daemon", "--is-coordinator", "--insecure",
        "--local-socket", str(tmp_path / "d.sock"), "--peer-bind", "tcp://0.0.0.0:0",
    ]  # fmt: skip
    script = f'hostname {hostname} && exec "$@"'
    return subprocess.run(
        ["unshare", "--uts", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _can_unshare_uts() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--uts", "hostname", "x"], capture_output=True, timeout=10)
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare_uts(), reason="needs unshare --uts (root)")
@pytest.mark.parametrize(
    ("hostname", "needle"), [("localhost", "loopback"), (UNRESOLVABLE, "does not resolve")]
)
def test_daemon_refuses_to_advertise_loopback_or_nothing(
    tmp_path: Path, hostname: str, needle: str
) -> None:
    r = _daemon_in_uts(hostname, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert '"code": "invalid"' in r.stdout and needle in r.stdout, r.stdout + r.stderr
    assert "set advertise_host" in r.stdout and hostname in r.stdout


def test_tcp_streams_default_follows_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp_streams = 0 (the default): 4 streams, or one per core where there are fewer
    (each stream's copies and tags take a core); a number given is kept; below 0 refused."""
    for cores, want in ((1, 1), (2, 2), (3, 3), (16, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert _cfg(peer_bind="tcp://127.0.0.1:0").resolved().tcp_streams == want
    assert _cfg(peer_bind="tcp://127.0.0.1:0", tcp_streams=8).resolved().tcp_streams == 8
    with pytest.raises(ConfigError, match="tcp_streams -1"):
        _cfg(peer_bind="tcp://127.0.0.1:0", tcp_streams=-1).resolved()


def test_tcp_bounce_bytes_is_whole_mib() -> None:
    """The pinned memory a tcp stream may hold for GPU regions: 64 MiB by default, a whole
    number of MiB (pieces are whole 1 MiB records), at least one; anything else refused."""
    assert _cfg(peer_bind="tcp://127.0.0.1:0").resolved().tcp_bounce_bytes == 64 << 20
    assert _cfg(peer_bind="tcp://127.0.0.1:0", tcp_bounce_bytes=1 << 20).resolved()
    for bad in (0, -1, (1 << 20) - 1, (8 << 20) + 1):
        with pytest.raises(ConfigError, match=f"tcp_bounce_bytes {bad} "):
            _cfg(peer_bind="tcp://127.0.0.1:0", tcp_bounce_bytes=bad).resolved()
