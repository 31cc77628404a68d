"""Shared region files: liveness for the stale-file sweep is the owner's flock, which
holds across PID namespaces (a rank in a container), where the pid in the name does not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weightwire.memory.hostmem import create_shared, open_shared, sweep_stale
from weightwire.protocol.errors import ErrorCode, RegistrationError

CREATOR = """
import os, sys
from weightwire.memory.hostmem import create_shared
f = create_shared(4096, purpose="engine-r0", directory=sys.argv[1])
print(os.getpid(), f.path, flush=True)
sys.stdin.read()  # hold the file until the test closes our stdin
"""

IN_NAMESPACE = """
import subprocess, sys
# the next pid in this namespace: one no process of the host namespace has
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(sys.argv[1])
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[2], sys.argv[3]]))
"""


def _dead_host_pid() -> int:
    """A pid with no live process here, and none within 50 above it."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    live = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    for start in range(min(pid_max - 100, max(live) + 1000), 300, -997):
        if not any(p in live for p in range(start, start + 50)):
            return start
    pytest.skip("no free pid range found")


def test_region_files_of_a_rank_in_another_pid_namespace_are_kept(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace needs root and unshare(1)")
    start = _dead_host_pid()
    rank = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            IN_NAMESPACE,
            str(start),
            CREATOR,
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdin is not None and rank.stdout is not None
    try:
        pid_text, path = rank.stdout.readline().split()
        pid = int(pid_text)
        assert pid > start and f"weightwire.{pid}.engine-r0." in path
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # to this namespace, the name's pid is a process that is gone
        dead = create_shared(4096, purpose="crashed", directory=str(tmp_path))
        assert dead.close()  # as if its owner died: nobody holds its lock (its pid lives)
        removed = sweep_stale(str(tmp_path))
        assert removed == [os.path.basename(dead.path)]
        assert os.path.exists(path), "the sweep deleted a live rank's region file"
    finally:
        rank.stdin.close()
        assert rank.wait(30) == 0
    assert sweep_stale(str(tmp_path)) == [os.path.basename(path)]  # now its owner is gone
    assert os.listdir(tmp_path) == []


def test_region_paths_with_a_nul_or_outside_the_directory_are_invalid(tmp_path: Path) -> None:
    f = create_shared(4096, purpose="test", directory=str(tmp_path))
    try:
        for bad, why in (
            (f.path + "\0x", "NUL"),
            ("/etc/passwd", f"not in {tmp_path}"),
            (str(tmp_path / ".." / os.path.basename(f.path)), f"not in {tmp_path}"),
        ):
            with pytest.raises(RegistrationError) as err:
                open_shared(bad, 4096, str(tmp_path))
            assert err.value.code is ErrorCode.INVALID and why in err.value.message
        g = open_shared(f.path, 4096, str(tmp_path))
        g.view[:4] = b"abcd"
        assert bytes(f.view[:4]) == b"abcd"
        assert g.close()
    finally:
        f.unlink()
        assert f.close()
