"""The daemons' log (their stdout) on a full filesystem: a 1 MiB tmpfs mounted for the test
holds every daemon's log, key files, sockets and ready file, and is filled to the last byte
once they have joined. Logging used to raise ENOSPC into whatever logged the line (the
daemon died at its next line); now the lines are dropped and counted, versions still land
bitwise, and once there is room the log says how many lines were lost, every line whole."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster

from .conftest import FAST, NETNS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def fill(directory: Path) -> Path:
    """A file that takes every byte left in `directory`'s filesystem."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * 4096
        while True:
            try:
                if os.write(fd, chunk) == 0:
                    break
            except OSError:  # ENOSPC: now full
                break
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        (directory / "probe").write_bytes(b"x" * 4096)
    (directory / "probe").unlink(missing_ok=True)
    return path


def pad_to_page(log: Path) -> None:
    """Fill the last page of `log` (a tmpfs gives space a page at a time, so a full one
    still takes bytes up to the end of a file's last page) with one line of padding."""
    room = -log.stat().st_size % 4096
    if room:
        line = b'{"p":"' + b"x" * (room - 9) + b'"}\n' if room >= 9 else b" " * (room - 1) + b"\n"
        with open(log, "ab") as f:
            f.write(line)
    assert log.stat().st_size % 4096 == 0


def publish(tr: Trainer, eng: Engine, version: int, w: torch.Tensor, dst: torch.Tensor) -> None:
    tr.publish(version, {"w": w * version})
    eng.wait(version, timeout_s=20)
    assert torch.equal(dst, w * version)


def test_daemons_keep_serving_when_their_log_filesystem_is_full(tmp_path: Path) -> None:
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "ww-logs", str(d)], check=True)
    c = LocalCluster(hosts=2, use_netns=NETNS, extra=FAST, workdir=d)
    try:
        c.start()
        c.wait_joined()
        filler = fill(d)
        for x in c.daemons:
            pad_to_page(x.log_path)
        w = torch.arange(64 << 10, dtype=torch.float32)
        dst = torch.zeros_like(w)
        tr = Trainer(0, 1, socket=c.daemons[0].socket, job="full-log", timeout_s=20)
        eng = Engine(0, 1, socket=c.daemons[1].socket, job="full-log", timeout_s=20)
        try:
            tr.register({"w": w.clone()})
            eng.register({"w": dst})
            for version in (1, 2):
                publish(tr, eng, version, w, dst)
            for x in c.daemons:
                assert x.proc.poll() is None, f"{x.node} died: {x.log_path.read_text()[-2000:]}"
                assert fetch(x.socket)["node"] == x.node
            assert all(x.log_path.stat().st_size % 4096 == 0 for x in c.daemons)
            filler.unlink()
            publish(tr, eng, 3, w, dst)
        finally:
            tr.close()
            eng.close()
        for x in c.daemons:
            lines = [line for line in x.log_path.read_text().splitlines() if line.strip()]
            records = [json.loads(line) for line in lines]  # every line whole
            notes = [r for r in records if r.get("event") == "log lines dropped"]
            assert notes and notes[0]["dropped"] > 0, (x.node, lines[-5:])
    finally:
        codes = c.stop()
        subprocess.run(["umount", "-l", str(d)], check=False)
    assert codes == [0, 0], codes


def test_daemons_keep_serving_past_their_file_size_limit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE set on the running daemons at their logs' sizes: every further line is
    EFBIG (Python ignores SIGXFSZ), and used to kill the daemon as ENOSPC did."""
    import resource

    c = LocalCluster(hosts=2, use_netns=NETNS, extra=FAST, workdir=tmp_path)
    try:
        c.start()
        c.wait_joined()
        for x in c.daemons:
            size = x.log_path.stat().st_size
            # the soft limit: raising it again needs no CAP_SYS_RESOURCE
            resource.prlimit(x.proc.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
        w = torch.arange(64 << 10, dtype=torch.float32)
        dst = torch.zeros_like(w)
        tr = Trainer(0, 1, socket=c.daemons[0].socket, job="fsize", timeout_s=20)
        eng = Engine(0, 1, socket=c.daemons[1].socket, job="fsize", timeout_s=20)
        try:
            tr.register({"w": w.clone()})
            eng.register({"w": dst})
            for version in (1, 2):
                publish(tr, eng, version, w, dst)
            for x in c.daemons:
                assert x.proc.poll() is None, f"{x.node} died"
                assert fetch(x.socket)["node"] == x.node
                unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
                resource.prlimit(x.proc.pid, resource.RLIMIT_FSIZE, unlimited)
            publish(tr, eng, 3, w, dst)
        finally:
            tr.close()
            eng.close()
    finally:
        codes = c.stop()
    assert codes == [0, 0], codes
    # read once the daemons have stopped: the note goes out with the next line a daemon
    # writes, and a version's line comes after its rank was answered (a read right after
    # the publish raced it under load)
    for x in c.daemons:
        records = [json.loads(line) for line in x.log_path.read_text().splitlines()]
        notes = [r for r in records if r.get("event") == "log lines dropped"]
        assert notes and notes[0]["dropped"] > 0, (x.node, records[-5:])


def test_a_ready_file_on_a_full_filesystem_is_a_named_startup_error(tmp_path: Path) -> None:
    """The daemon logged "daemon ready", then died of a bare `[Errno 28] No space left on
    device`, leaving its sockets and a partial ready file behind. Now: one `no_space` error
    naming the file, nothing left behind, exit 1."""
    import sys

    d = tmp_path / "full"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "ww-ready", str(d)], check=True)
    try:
        fill(d)
        sock = tmp_path / "x.sock"
        out = subprocess.run(
            [sys.executable, "-m", "weightwire.daemon", "--insecure", "--is-coordinator",
             "--node=x", f"--local-socket={sock}", "--peer-bind=tcp://127.0.0.1:0",
             f"--ready-file={d / 'ready.json'}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1, out
        records = [json.loads(line) for line in out.stdout.splitlines()]
        assert not [r for r in records if r.get("event") == "daemon ready"], records
        last = records[-1]
        assert last["event"] == "daemon failed" and last["code"] == "no_space", last
        assert f"cannot write ready_file {d / 'ready.json'}" in last["error"], last
        assert sorted(p.name for p in d.iterdir()) == ["filler"]
        assert not list(tmp_path.glob("x.sock*")), list(tmp_path.glob("x.sock*"))
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
