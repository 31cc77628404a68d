"""The README's quick start, run as written on two hosts: each host is a network namespace
with its own host name (UTS namespace) and its own /etc/weightwire and /run/weightwire
(bind mounts in a private mount namespace). Only the copy between hosts (`scp`) is done by
the test, and the example addresses are the namespaces' own."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from weightwire.harness import netns

from .conftest import NETNS, NETNS_WHY

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not NETNS, reason=f"needs network namespaces: {NETNS_WHY}"),
]
MOUNTS = ("/etc/weightwire", "/run/weightwire")


def quickstart() -> list[tuple[str, str]]:
    """(which host, command) from the README's quickstart block, continuations joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart:begin -->\n```sh\n(.*?)```", text, re.S)
    assert block, "README has no quickstart block"
    out: list[tuple[str, str]] = []
    where = ""
    for line in block.group(1).replace("\\\n", " ").splitlines():
        line = line.strip()
        if m := re.match(r"# on (every host|host A|host B|either host)", line):
            where = m.group(1)
        elif line and not line.startswith("#"):
            out.append((where, re.sub(r"\s+", " ", line)))
    return out


@dataclass
class Host:
    name: str
    ns: str
    address: str
    dirs: Path

    def local(self, path: str) -> Path:
        """Where this host's /etc/weightwire/... or /run/weightwire/... really is."""
        for i, m in enumerate(MOUNTS):
            if path.startswith(m):
                return self.dirs / str(i) / path[len(m) :].lstrip("/")
        raise AssertionError(f"{path} is outside the host's private directories")

    def argv(self, command: str) -> list[str]:
        binds = " && ".join(f"mount --bind {self.dirs / str(i)} {m}" for i, m in enumerate(MOUNTS))
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        script = f"hostname {self.name} && {binds} && export PATH={path} && {command}"
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-ec", script]  # fmt: skip


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[list[Host]]:
    made = []
    for m in MOUNTS:  # mount points; the hosts' contents live under tmp_path
        if not os.path.isdir(m):
            os.makedirs(m, exist_ok=True)
            made.append(m)
    net = netns.Hosts(2)
    out = []
    for i, name in enumerate(("A", "B")):
        for j in range(len(MOUNTS)):
            (tmp_path / name / str(j)).mkdir(parents=True)
        out.append(Host(name, net.names[i], net.addresses[i], tmp_path / name))
    try:
        yield out
    finally:
        net.close()
        for m in made:
            with contextlib.suppress(OSError):
                os.rmdir(m)


def test_readme_quickstart_on_two_hosts(hosts: list[Host], tmp_path: Path) -> None:
    a, b = hosts
    steps = quickstart()
    assert [w for w, _ in steps] == [
        "every host", "every host", "every host", "host A", "host B", "either host",
    ]  # fmt: skip
    daemons: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for where, command in steps:
            command = command.replace("10.0.0.1", a.address).replace("10.0.0.2", b.address)
            targets = {"every host": [a, b], "host A": [a], "host B": [b]}.get(where, [a, b])
            for host in targets:
                if command.startswith("scp "):  # the copy between hosts: done here
                    _, src, dest = command.split()
                    other = b if host is a else a
                    src = src.replace("$(hostname)", host.name)
                    target = other.local(dest.split(":", 1)[1]) / Path(src).name
                    shutil.copy(host.local(src), target)
                elif command.endswith("&"):  # a daemon: runs in the background
                    log = tmp_path / f"{host.name}.log"
                    with open(log, "wb") as f:
                        p = subprocess.Popen(
                            host.argv("exec " + command[:-1].strip()),
                            stdout=f,
                            stderr=subprocess.STDOUT,
                        )
                    daemons.append((p, log))
                elif command.startswith("weightwire status"):
                    text = _until_both_listed(host, command, daemons)
                    assert "cluster as seen from" in text and "NO ANSWER" not in text, text
                else:
                    r = subprocess.run(
                        host.argv(command), capture_output=True, text=True, timeout=60
                    )
                    assert r.returncode == 0, f"{host.name}: {command}: {r.stdout}{r.stderr}"
        # both keys were made where the quick start says, and each host trusts the other
        for host, other in ((a, b), (b, a)):
            assert host.local(f"/etc/weightwire/{host.name}.key_secret").exists()
            assert host.local(f"/etc/weightwire/peers.d/{other.name}.key").exists()
    finally:
        for p, _ in daemons:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p, _ in daemons:
            try:
                codes.append(p.wait(20))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(-9)
    logs = "\n".join(log.read_text()[-3000:] for _, log in daemons)
    assert codes == [0, 0], logs


def _until_both_listed(
    host: Host, command: str, daemons: list[tuple[subprocess.Popen[bytes], Path]]
) -> str:
    """`status --cluster` once both daemons are up and joined (they were just started)."""
    deadline = time.monotonic() + 30
    last = ""
    while time.monotonic() < deadline:
        for p, log in daemons:
            assert p.poll() is None, f"a daemon exited ({p.returncode}): {log.read_text()}"
        r = subprocess.run(host.argv(command), capture_output=True, text=True, timeout=30)
        last = r.stdout + r.stderr
        listed = {ln.split()[0] for ln in r.stdout.splitlines() if " weightwired " in ln}
        if r.returncode == 0 and listed == {"A", "B"}:
            return r.stdout
        time.sleep(0.5)
    raise AssertionError(f"status --cluster never listed both daemons: {last}")
