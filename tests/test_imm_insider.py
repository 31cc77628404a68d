"""An insider that is a planned source of one engine rank counts immediates toward another.

Three real daemons in namespaces. host2 is a real weightwired with a valid key, the
planned source of job "cover"'s engine rank on host1, whose poster (patched in that
process, as a compromised node would be) tags every write with the immediate of job
"victim"'s engine rank on host1 (its slot, the victim's next version). Its bytes land where
its grant allows (cover's region), but the immediates used to count for the victim: the
victim's version completed as soon as its trainer had announced it, before any of its
bytes were sent. Now an immediate counts only from the rank's planned sources, as the
version's start, bucket and abort messages already did."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import WeightwireError
from weightwire.protocol.plan import encode_imm

from .conftest import FAST, NETNS, NETNS_WHY

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")

EVIL = """
import json, os, sys
from weightwire.daemon import posting
honest = posting.Poster._post_part

def post_part(self, run, bucket, p, imms, fenced, gated):
    try:
        with open(os.environ["WW_EVIL_IMM"]) as f:
            imms = [json.load(f)["imm"]] * len(imms)
    except FileNotFoundError:
        pass
    return honest(self, run, bucket, p, imms, fenced, gated)

posting.Poster._post_part = post_part
from weightwire.daemon.main import main
sys.exit(main(sys.argv[3:]))
"""
SIZES = {"max-write-bytes": str(64 << 10), "bucket-bytes": str(256 << 10)}


def test_immediates_count_only_from_the_ranks_planned_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evil = tmp_path / "imm.json"
    monkeypatch.setenv("WW_EVIL_IMM", str(evil))
    c = LocalCluster(hosts=3, use_netns=True, extra={**FAST, **SIZES})
    c.start()
    try:
        c.daemons[2].proc.terminate()
        assert c.daemons[2].proc.wait(15) == 0
        c.python = ["-c", EVIL]  # host2 again: the same node and key, its poster patched
        c.start_daemon(2, node="host2")
        c.python = []
        c.wait_joined()
        victim_w = torch.arange(4096, dtype=torch.float32)  # 16 KiB: one write
        cover_w = torch.arange(65536, dtype=torch.float32)  # 256 KiB: four writes
        victim_dst, cover_dst = torch.zeros_like(victim_w), torch.zeros_like(cover_w)
        victim_eng = Engine(0, 1, socket=c.daemons[1].socket, job="victim", timeout_s=30)
        victim_eng.register({"w": victim_dst})
        cover_eng = Engine(0, 1, socket=c.daemons[1].socket, job="cover", timeout_s=30)
        cover_eng.register({"w": cover_dst})
        victim_tr = Trainer(0, 1, socket=c.daemons[0].socket, job="victim", timeout_s=30)
        victim_tr.register({"w": victim_w.clone()})
        cover_tr = Trainer(0, 1, socket=c.daemons[2].socket, job="cover", timeout_s=30)
        cover_tr.register({"w": cover_w.clone()})
        try:
            for tr, eng in ((victim_tr, victim_eng), (cover_tr, cover_eng)):
                tr.publish(1)
                eng.wait(1)
            assert torch.equal(victim_dst, victim_w) and torch.equal(cover_dst, cover_w)
            receiving = {r["job"]: r for r in fetch(c.daemons[1].socket)["receiving"]}
            assert receiving["victim"]["sources"] == ["host0"], receiving
            assert receiving["victim"]["expected_writes"] == 1, receiving
            evil.write_text(json.dumps({"imm": encode_imm(2, receiving["victim"]["slot"])}))

            # the victim's trainer announces version 2, and packs it 4 s later
            packer = victim_tr._packer
            pack = packer.pack_bucket

            def slow_pack(*args: object, **kwargs: object) -> object:
                time.sleep(4)
                return pack(*args, **kwargs)

            monkeypatch.setattr(packer, "pack_bucket", slow_pack)
            published: dict[str, object] = {}

            def publish_victim() -> None:
                try:
                    published["stats"] = victim_tr.publish(2, {"w": victim_w * 2})
                except WeightwireError as exc:
                    published["error"] = exc

            t = threading.Thread(target=publish_victim)
            t.start()
            time.sleep(1.0)
            cover_tr.publish(2, {"w": cover_w * 2})  # lands in cover's region, tagged for victim
            assert torch.equal(cover_dst, cover_w * 2)  # its grant: the bytes land
            with pytest.raises(WeightwireError):  # nothing of the victim's version 2 was sent
                victim_eng.wait(2, timeout_s=2)
            assert torch.equal(victim_dst, victim_w)
            t.join(30)
            assert "stats" in published, published
            victim_eng.wait(2, timeout_s=20)
            assert torch.equal(victim_dst, victim_w * 2)
            lines = [
                r
                for r in c.daemons[1].logs()
                if r.get("event") == "immediate from a node that is no source of its rank; "
                "not counted"
            ]
            assert lines and lines[0]["peer"] == "host2" and lines[0]["job"] == "victim", lines
        finally:
            for x in (victim_tr, cover_tr, victim_eng, cover_eng):
                x.close()
    finally:
        c.stop()
