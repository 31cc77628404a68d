"""A local process that speaks the local socket (any process that may open it: the
socket's mode is the only key) attacking what changed most recently: `GetPlan` with an
`after_plan` (the plan the rank has), asked again and again; many clients at once. Real
daemons, the requests on the real socket."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.frames import Codec
from weightwire.protocol.local import (
    Error,
    GetPlan,
    Goodbye,
    Hello,
    LocalMessage,
    PlanReply,
    WaitVersion,
)

from .test_bad_inputs import healthy_sync, raw_socket


def test_waits_that_time_out_leave_nothing_behind(cluster: LocalCluster) -> None:
    """A trainer rank asks 300 times for a plan other than the one it has (none comes),
    and an engine rank of a job without a plan waits 300 times for a version, each with a
    short timeout. Every wait used to leave its future in the job's waiters until the
    plan next changed (never, in a steady job): the daemon grew by one per request. Now
    `plan_waits` is back to what it was once they have timed out."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 64, generator=g)
    dst = torch.zeros_like(w)
    job = "after-plan-flood"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=20)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=20)
    sock = cluster.daemons[0].socket
    before = fetch(sock)["plan_waits"]
    try:
        eng.register({"w": dst})
        tr.register({"w": w})
        plan = tr.prepare().plan_hash
        n = 300
        for _ in range(n):
            with pytest.raises(PlanError) as err:
                tr._conn.request(GetPlan(timeout_s=0.001, after_plan=plan), 10)
            assert err.value.code is ErrorCode.NOT_READY
        # a bogus after_plan (no plan has it): the plan at once
        got = tr._conn.request(GetPlan(timeout_s=5, after_plan="f" * 128), 10)
        assert isinstance(got, PlanReply) and got.plan.plan_hash == plan
        # engine waits for a version of a job that has no plan, pipelined in rounds
        codec = Codec(LocalMessage)
        s = raw_socket(sock)
        hello = Hello(protocol=PROTOCOL_VERSION, role="engine", rank=0, job="no-plan-flood")
        s.send_multipart(codec.encode(hello))
        s.recv_multipart()
        for round_ in range(6):
            for i in range(50):
                req = 1 + round_ * 50 + i
                s.send_multipart(codec.encode(WaitVersion(req=req, version=1, timeout_s=0.001)))
            for _ in range(50):
                reply, _ = codec.decode(s.recv_multipart())
                assert isinstance(reply, Error) and reply.code == "timeout", reply
        s.send_multipart(codec.encode(Goodbye()))
        s.close()
        assert fetch(sock)["plan_waits"] == before, "timed-out waits left behind"
        tr.publish(0)
        eng.wait(0)
        assert torch.equal(dst.view(torch.uint8), w.view(torch.uint8))
    finally:
        tr.close()
        eng.close()


def test_many_local_clients_at_once(cluster: LocalCluster) -> None:
    """16 pairs (32 ranks) of 16 jobs connect and sync through the two daemons at the
    same time, two versions each; every engine's bytes checked bitwise, and the daemons
    serve a good job after."""
    pairs = 16
    errors: list[BaseException] = []

    def one(i: int) -> None:
        job = f"crowd-{i}"
        w = torch.full((32, 32), float(i))
        dst = torch.zeros_like(w)
        eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=60)
        tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=60)
        try:
            eng.register({"w": dst})
            tr.register({"w": w})
            for version in (0, 1):
                tr.publish(version, {"w": w + version})
                eng.wait(version)
                assert torch.equal(dst, w + version), (job, version)
        except BaseException as exc:
            errors.append(exc)
        finally:
            tr.close()
            eng.close()

    t0 = time.monotonic()
    with ThreadPoolExecutor(pairs) as pool:
        done = [f.result(120) for f in [pool.submit(one, i) for i in range(pairs)]]
    assert len(done) == pairs
    assert not errors, errors
    print(f"{pairs} pairs, two versions each: {time.monotonic() - t0:.1f} s")
    healthy_sync(cluster, "after-crowd")
