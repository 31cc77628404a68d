"""End to end over RDMA: two weightwired daemons that use the verbs transport, one on
10.233.0.1 (rxe1, rxe2) and one on 10.233.0.2 (rxe2, rxe1), two trainer rank processes and
an engine process holding two TP ranks, all with the real clients. Host memory has two
lanes here (verbs_host_nics = 2), so the planner stripes the large writes over both NIC
pairs and the engines count every stripe's immediate. Every byte is checked bitwise.

Then a fault: the writing daemon gives one write a wrong rkey past the descriptor check
(WEIGHTWIRE_VERBS_FAULT_FILE), the NIC refuses it with an error completion, the version
fails at the trainers and the engines, the daemons keep serving, the queue pair is rebuilt,
and the next version lands.

Runs in the Soft-RoCE VM with torch in .venv-rdma (`make test-rdma` sets RDMA_VM_TORCH=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.transport.verbs import available
from weightwire.transport.verbs.transport import FAULT_ENV

from ..jsonproc import JsonLinesProc

OK, WHY = available()
PAIR = os.environ.get("WEIGHTWIRE_RDMA_PAIR", "").split()
ADDRESSES = ["10.233.0.1", "10.233.0.2"]  # rxe1 / rxe2 netdevs in the VM (scripts/rdma-vm.sh)
TORCH = importlib.util.find_spec("torch") is not None
HERE = Path(__file__).parent
pytestmark = pytest.mark.rdma
if not OK:
    pytest.skip(f"no RDMA device ({WHY}); make test-rdma runs it", allow_module_level=True)
if len(PAIR) != 2 or not TORCH:
    pytest.skip(
        "needs the Soft-RoCE VM's rxe1/rxe2 pair and torch (make test-rdma)",
        allow_module_level=True,
    )
FAST = {
    "heartbeat-interval-s": "0.3",
    "heartbeat-timeout-s": "6",  # a loaded 2-core TCG VM: no false losses
    "session-timeout-s": "20",
    "stall-timeout-s": "20",
    "transport": "verbs",
    "verbs-host-nics": "2",
    "verbs-chunk-bytes": str(1 << 20),  # several WRs per write, chained
    "log-level": "info",
}


@dataclass
class VerbsCluster(LocalCluster):
    """LocalCluster on given addresses (the VM's veth pair), each daemon with its devices."""

    addresses: list[str] = field(default_factory=lambda: list(ADDRESSES))
    devices: list[str] = field(default_factory=list)

    def address(self, host: int) -> str:
        return self.addresses[host]

    def start(self) -> VerbsCluster:
        for host in range(self.hosts):
            self.keys(f"host{host}")
        self.start_daemon(0, coordinator=True, flags={"verbs-devices": self.devices[0]})
        self.start_daemon(1, flags={"verbs-devices": self.devices[1]})
        return self


class Proc(JsonLinesProc):
    def __init__(self, *args: str) -> None:
        super().__init__(HERE / "ranks.py", *args, pythonpath=HERE.parent.parent)

    def wait_for(self, timeout: float, count: int = 1, **match: object) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = [e for e in self.events if all(e.get(k) == v for k, v in match.items())]
                if len(got) >= count:
                    return got
                if self.p.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"no {count}x {match} in {timeout} s (rc {self.p.poll()}): "
                        f"{self.events}\n{''.join(self.err[-30:])}"
                    )
                self._cv.wait(0.2)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[VerbsCluster]:
    monkeypatch.setenv(FAULT_ENV, str(tmp_path / "fault"))  # the daemons inherit it
    a, b = PAIR
    c = VerbsCluster(hosts=2, extra=FAST, devices=[f"{a},{b}", f"{b},{a}"])
    try:
        c.start()
        c.wait_joined(60)
        yield c
        codes = c.stop()
        assert codes == [0, 0], f"daemons exited with {codes}; logs in {c.workdir}"
    finally:
        c.stop()
        keep = os.environ.get("WEIGHTWIRE_RDMA_LOGS")  # a host dir (RDMA_VM_RWDIRS): keep logs
        if keep:
            for f in c.workdir.glob("*.log"):
                shutil.copy(f, Path(keep) / f.name)


def verbs_stats(c: VerbsCluster, host: int) -> dict[str, Any]:
    st = fetch(c.daemons[host].socket)
    return st["transports"]  # type: ignore[no-any-return]


@pytest.mark.timeout(480)
def test_update_over_verbs_bitwise_then_error_completion_and_recovery(
    cluster: VerbsCluster, tmp_path: Path
) -> None:
    job = "rdma"
    t0 = time.monotonic()
    engines = Proc("engines", "--socket", cluster.daemons[1].socket, "--world", "2", "--job", job)
    sock = cluster.daemons[0].socket
    trainers = [
        Proc("trainer", "--socket", sock, "--rank", str(r), "--world", "2", "--job", job)
        for r in range(2)
    ]
    procs = [engines, *trainers]
    try:
        engines.wait_for(300, event="ready")
        for tr in trainers:
            tr.wait_for(300, event="ready")
        startup = time.monotonic() - t0

        def version(v: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            engines.send(str(v))
            for tr in trainers:
                tr.send(str(v))
            done = [tr.wait_for(90, version=v)[0] for tr in trainers]
            landed = engines.wait_for(90, count=2, version=v)
            return done, landed

        timings = {}
        for v in (1, 2):
            t = time.monotonic()
            done, landed = version(v)
            timings[v] = time.monotonic() - t
            assert all(d["event"] == "done" for d in done), done
            assert all(e["event"] == "landed" and e["bitwise"] for e in landed), landed

        st0, st1 = verbs_stats(cluster, 0), verbs_stats(cluster, 1)
        assert st0["verbs"]["bytes_sent"] > 0 and st0["tcp"]["bytes_sent"] == 0, st0
        assert st0["verbs"]["links"] == 2, st0  # both lanes: rxe1 -> rxe2 and rxe2 -> rxe1
        writes = sum(d["writes"] for d in done)
        assert st1["verbs"]["imms_received"] == 2 * writes, (st1, done)
        assert st0["verbs"]["qp_rebuilds"] == 0

        # One write gets a wrong rkey: the NIC refuses it, the version fails everywhere.
        (tmp_path / "fault").write_text("rkey")
        done, landed = version(3)
        assert not (tmp_path / "fault").exists()
        assert any(d["event"] == "error" for d in done), done
        assert all(e["event"] == "failed" for e in landed), landed
        errors = [d for d in done if d["event"] == "error"]
        assert any("host1" in d["message"] for d in errors), errors
        # The engine's daemon fenced the trainer host before reporting the failure: its
        # queue pairs went to the error state and the writer, told so, forgot its links.
        deadline = time.monotonic() + 30
        while verbs_stats(cluster, 0)["verbs"]["links"] != 0:
            assert time.monotonic() < deadline, verbs_stats(cluster, 0)
            time.sleep(0.2)

        # The daemons kept serving; new queue pairs carry the next version.
        t = time.monotonic()
        done, landed = version(4)
        timings[4] = time.monotonic() - t
        assert all(d["event"] == "done" for d in done), done
        assert all(e["event"] == "landed" and e["bitwise"] for e in landed), landed
        st0 = verbs_stats(cluster, 0)
        assert st0["verbs"]["error_completions"] >= 1 and st0["tcp"]["bytes_sent"] == 0, st0
        print(
            f"\nrdma e2e: startup (torch imports, plan) {startup:.1f} s; versions "
            + ", ".join(f"v{v} {s:.2f} s" for v, s in timings.items())
            + f"; {sum(d['bytes'] for d in done)} bytes per version; verbs stats {st0['verbs']}"
        )
        for p in procs:
            assert p.finish() == 0, p.err[-20:]
    finally:
        for p in procs:
            p.kill()
