"""`weightwire status`: `--cluster` from any node shows every daemon, job and the version in
flight; plans and IMPOSSIBLE entries go once every rank has left; a status call logs
nothing at info."""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from weightwire.cli.main import main
from weightwire.client import Engine
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster

from .test_e2e import Proc, bitwise, engine_for, expected_rows


def wait_until(what: str, check: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} in {timeout} s")
        time.sleep(0.1)


def test_cluster_status_from_any_node_during_a_version(cluster: LocalCluster, capsys) -> None:  # type: ignore[no-untyped-def]
    job = "seen"
    eng, mine = engine_for(cluster, job)  # on host1
    sock0, sock1 = cluster.daemons[0].socket, cluster.daemons[1].socket
    fast = Proc(cluster, 0, "--socket", sock0, "--rank", "0", "--world", "2", "--job", job)
    slow = Proc(
        cluster, 0, "--socket", sock0, "--rank", "1", "--world", "2", "--job", job, "--delay", "4"
    )
    try:
        fast.publish(1)
        slow.publish(1)
        fast.wait_for("done", version=1)
        # mid-version, asked through the engine's node (not the coordinator)
        assert main(["status", "--socket", sock1, "--cluster", "--json"]) == 0
        c = json.loads(capsys.readouterr().out)
        assert c["asked"] == "host1" and set(c["nodes"]) == {"host0", "host1"}
        h0, h1 = c["nodes"]["host0"], c["nodes"]["host1"]
        assert "error" not in h0 and "error" not in h1, c
        assert {(s["role"], s["rank"]) for s in h0["sessions"]} == {("trainer", 0), ("trainer", 1)}
        assert [(s["role"], s["rank"]) for s in h1["sessions"]] == [("engine", 0)]
        assert h0["plans"][job] == h1["plans"][job]
        states = {p["rank"]: p["state"] for p in h0["publishing"]}
        assert states[0] == "done"
        (rx,) = h1["receiving"]
        (flight,) = rx["in_progress"]
        assert flight["version"] == 1 and 0 < flight["fraction"] < 1
        assert h0["coordination"]["jobs"][job]["plan"] == h0["plans"][job]
        # the text form names every daemon and the job's ranks
        assert main(["status", "--socket", sock1, "--cluster"]) == 0
        text = capsys.readouterr().out
        assert "cluster as seen from host1" in text and f"job {job!r}" in text
        assert "host0 trainer rank 0: version 1 done" in text
        assert "host1 engine rank 0: last complete v-1, now v1" in text
        eng.wait(1, timeout_s=60)
        for n, t in mine.items():
            assert bitwise(t, expected_rows(1)[n])
        assert fast.finish() == 0 and slow.finish() == 0
    finally:
        for p in (fast, slow):
            p.kill()
        eng.close()
    # every rank has left: no plan, no job, anywhere
    for sock in (sock0, sock1):
        wait_until("plans dropped", lambda s=sock: not fetch(s)["plans"])
    wait_until("job ended", lambda: job not in fetch(sock0)["coordination"]["jobs"])
    # status calls (many above) wrote no info lines
    for d in cluster.daemons:
        chatter = [e for e in d.logs() if e.get("role") == "admin" and e.get("level") == "info"]
        assert not chatter, chatter[:2]


def test_impossible_plan_goes_when_its_ranks_leave(cluster: LocalCluster) -> None:
    job = "impossible"
    sock0, sock1 = cluster.daemons[0].socket, cluster.daemons[1].socket
    trainer = Proc(cluster, 0, "--socket", sock0, "--rank", "0", "--world", "1", "--job", job)
    eng = Engine(0, 1, socket=sock1, job=job, timeout_s=30)
    try:
        eng.register({"embed": torch.zeros(7, 3, dtype=torch.bfloat16)})  # wrong shape
        wait_until("plan refused", lambda: job in fetch(sock1)["plan_problems"], timeout=30)
    finally:
        eng.close()
        trainer.p.kill()
        trainer.p.wait(10)
    for sock in (sock0, sock1):
        wait_until(
            "problem dropped",
            lambda s=sock: job not in fetch(s)["plan_problems"] and job not in fetch(s)["plans"],
        )
    wait_until("job ended", lambda: job not in fetch(sock0)["coordination"]["jobs"])
