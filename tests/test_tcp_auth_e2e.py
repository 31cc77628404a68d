"""Forged data-plane writes, tried for real (issue 14, item 2): three hosts in network
namespaces, CURVE on, a passive tap on the engine's link. With the rkeys, region ids and
immediates it captured, a keyless third host and a valid-key insider that no plan names
as a source try to write 0xFF into the engine's weights: not one byte lands, nothing is
acknowledged, and the next real version completes bitwise. With encryption on, the tap
reads no header at all and versions still land bitwise."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.plan import encode_imm

from .conftest import FAST, NETNS, NETNS_WHY
from .jsonproc import JsonLinesProc

HERE = Path(__file__).parent
MiB = 1 << 20
pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs network namespaces: {NETNS_WHY}")


class Tool(JsonLinesProc):
    def __init__(self, prefix: list[str], script: str, *args: str) -> None:
        super().__init__(HERE / "attack" / script, *args, pythonpath=HERE.parent, prefix=prefix)

    def wait_for(self, event: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while time.monotonic() < deadline:
                for e in self.events:
                    if e.get("event") == event:
                        return e
                if self.p.poll() is not None:
                    break
                self._cv.wait(0.2)
        raise AssertionError(f"no {event} from {self.p.args}: {self.events} {''.join(self.err)}")

    def outcome(self, timeout: float = 90) -> list[dict]:
        self.p.wait(timeout)
        assert self.p.returncode == 0, "".join(self.err)
        return self.events


def start(security: str) -> LocalCluster:
    flags = {**FAST, "max-write-bytes": str(MiB)}
    if security != "auth":  # the default (so this also runs against code that predates it)
        flags["tcp-security"] = security
    c = LocalCluster(hosts=3, use_netns=True, extra=flags)
    c.keys("mallory")  # a valid key that every daemon trusts, held by no daemon
    c.start()
    c.wait_joined()
    return c


@pytest.fixture
def clusters() -> Iterator[list[LocalCluster]]:
    made: list[LocalCluster] = []
    yield made
    for c in made:
        c.stop()


def ranks(c: LocalCluster, job: str) -> tuple[Trainer, Engine, torch.Tensor, torch.Tensor]:
    src = torch.randint(0, 255, (4 * MiB,), dtype=torch.uint8)  # never 0xFF: forgeries show
    dst = torch.zeros(4 * MiB, dtype=torch.uint8)
    eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=60)
    eng.register({"w": dst})
    tr = Trainer(0, 1, socket=c.daemons[0].socket, job=job)
    tr.register({"w": src})
    tr.prepare()
    return tr, eng, src, dst


def publish(tr: Trainer, eng: Engine, src: torch.Tensor, dst: torch.Tensor, v: int) -> None:
    src.copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8))
    tr.publish(v)
    assert eng.wait(v, timeout_s=60).version == v
    assert torch.equal(src, dst), f"version {v} did not land bitwise"


def tap(c: LocalCluster) -> Tool:
    """A capture on the switch port of host1 (the engine's link)."""
    assert c.net is not None
    t = Tool(["ip", "netns", "exec", c.net.switch], "capture.py", "p1")
    t.wait_for("listening")
    return t


@dataclass
class Captured:
    """A cluster after one version, with what the tap on the engine's link read."""

    cluster: LocalCluster
    trainer: Trainer
    engine: Engine
    src: torch.Tensor
    dst: torch.Tensor
    write: dict
    hello: dict | None
    version: int = 1

    def forged(self) -> dict:
        """A 64 KiB write of 0xFF at the region's start, with the captured region id and
        rkey and the next version's immediate."""
        return {
            "region": self.write["region"],
            "rkey": self.write["rkey"],
            "offset": 0,
            "length": 64 * 1024,
            "imm": encode_imm(self.version + 1, self.write["imm"] & 0xFFFF),
        }

    def next_version_lands(self) -> None:
        """Forged immediates counted nothing: the next real version completes, bitwise."""
        self.version += 1
        publish(self.trainer, self.engine, self.src, self.dst, self.version)


@pytest.fixture(scope="module")
def captured() -> Iterator[Captured]:
    c = start("auth")
    try:
        tr, eng, src, dst = ranks(c, "auth")
        cap = tap(c)
        publish(tr, eng, src, dst, 1)
        first = cap.wait_for("write")
        cap.finish()
        w = next((e for e in cap.events if e["event"] == "write" and e["imm"] >= 0), first)
        assert w["imm"] >= 0, "the tap saw no write with an immediate"
        hello = next(
            (e for e in cap.events if e["event"] == "hello" and e["node"] == "host0"), None
        )
        yield Captured(c, tr, eng, src, dst, w, hello)
        tr.close()
        eng.close()
    finally:
        c.stop()


def refusals(c: LocalCluster) -> list[dict]:
    return [
        e
        for e in c.daemons[1].logs()
        if e.get("event") == "tcp write refused; closing connection"
        and e.get("code") == "unauthorized"
    ]


def test_a_keyless_third_host_with_captured_rkeys_lands_nothing(captured: Captured) -> None:
    """It claims the trainer's name (or replays the trainer's captured hello) and sends
    four 64 KiB writes of 0xFF with the next version's immediate."""
    c = captured.cluster
    before = captured.dst.clone()
    tcp = c.daemons[1].ready["transports"]["tcp"]  # type: ignore[index]
    spec = {
        **captured.forged(),
        "count": 4,
        "claim": "host0",
        "replay": captured.hello["raw"] if captured.hello else "",
    }
    third = Tool(c.prefix(2), "forge.py", str(tcp["host"]), str(tcp["port"]), json.dumps(spec))
    attempts = third.outcome()
    assert attempts and all(a["acks"] == 0 for a in attempts), attempts
    assert all(a["refused"] and a["refused"]["code"] == "unauthorized" for a in attempts), attempts
    assert torch.equal(captured.dst, before), "a forged write landed in the engine's weights"
    assert refusals(c), "the refusals were not logged"
    captured.next_version_lands()


def test_a_valid_key_insider_that_is_no_planned_source_is_refused(captured: Captured) -> None:
    """Its key is allowed, so it may join and connect; it may not write where the plan does
    not name it as a source, whatever key and immediate it presents."""
    c = captured.cluster
    before = captured.dst.clone()
    spec = {
        "node": "mallory",
        "secret_key": str(c.workdir / "keys" / "mallory" / "mallory.key_secret"),
        "allowed_dir": str(c.workdir / "keys" / "public"),
        "coordinator": c.daemons[0].endpoint,
        "coordinator_key": c.coordinator_key(),
        "address": c.address(2),
        "target": "host1",
        "security": "auth",
        **captured.forged(),
    }
    insider = Tool(c.prefix(2), "insider.py", json.dumps(spec))
    (result,) = insider.outcome()
    assert result.get("connected"), (result, "".join(insider.err)[-3000:])
    assert result.get("written") is False, result
    assert result["error"]["code"] == "unauthorized", result
    assert "mallory is not a planned source" in result["error"]["message"], result
    assert torch.equal(captured.dst, before), "the insider's write landed"
    captured.next_version_lands()


def test_encrypted_versions_land_bitwise_and_the_tap_reads_no_header(
    clusters: list[LocalCluster],
) -> None:
    c = start("encrypt")
    clusters.append(c)
    tr, eng, src, dst = ranks(c, "secret")
    cap = tap(c)
    for v in (1, 2):
        publish(tr, eng, src, dst, v)
    time.sleep(0.5)
    cap.finish()
    assert not [e for e in cap.events if e["event"] == "write"], "a write header went in clear"
    tr.close()
    eng.close()
