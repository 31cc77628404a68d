"""A node's advert of a job (every rank of the job on that node, with its tensors and
regions) larger than max_message_bytes, although each rank's own messages fit: two engine
ranks behind one daemon, each declaring a list that fits. The coordinator dropped the
advert ("bad peer message") and the ranks waited for a plan to their timeout, told that
the coordinator waited for more ranks (it did: it never heard of them). Now the daemon
tells its ranks at once, with a `too_large` error naming the size and the setting, and
withdraws its ranks at the coordinator rather than leave an older advert to be planned;
it keeps serving other jobs. The same for a plan: the coordinator's plan for one node
larger than max_message_bytes was dropped by that node, and its trainer rank's publish
ended with "not_ready: waiting for []"; now every node of the job is told (too_large).
Real daemons in network namespaces."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.client.status import fetch
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError

from .conftest import FAST, NETNS, NETNS_WHY, serve
from .test_status_flood import pair

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")
LIMIT = 256 << 10
TENSORS = 1000  # each rank's declaration ~210 KiB: fits; the two ranks' advert does not


@pytest.fixture(scope="module")
def four() -> Iterator[LocalCluster]:
    extra = {**FAST, "max-message-bytes": str(LIMIT)}
    yield from serve(LocalCluster(hosts=4, use_netns=True, extra=extra))


def test_an_advert_too_large_for_the_coordinator_is_a_typed_error_at_once(
    four: LocalCluster,
) -> None:
    c = four
    names = [f"layer.{i}.a_rather_long_parameter_name.weight" for i in range(TENSORS)]
    with (
        Engine(0, 2, socket=c.daemons[1].socket, job="big", timeout_s=15) as e0,
        Engine(1, 2, socket=c.daemons[1].socket, job="big", timeout_s=15) as e1,
    ):
        e0.register({n: torch.zeros(4) for n in names})
        e1.register({n: torch.zeros(4) for n in names})
        t0 = time.monotonic()
        with pytest.raises(WeightwireError) as told:
            e0.wait(1, timeout_s=15)
        assert time.monotonic() - t0 < 5, "left to its timeout"
        err = told.value
        assert err.code is ErrorCode.TOO_LARGE, err
        assert "max_message_bytes" in err.message and "host1" in err.message, err
        assert "big" in fetch(c.daemons[1].socket)["plan_problems"]
    with pair(c, "small", 0, 1):
        pass  # the daemons serve on: a version of another job lands bitwise
    assert "big" not in fetch(c.daemons[1].socket)["plan_problems"]  # gone with its ranks


def test_a_plan_too_large_for_one_message_is_a_typed_error_for_the_job(
    four: LocalCluster,
) -> None:
    """3000 tensors, a third to each of three engine ranks on three hosts (each advert
    fits); the trainer's plan, writes to all three, does not."""
    c = four
    names = [f"layer.{i}.p.weight" for i in range(3000)]
    with contextlib.ExitStack() as stack:
        tr = stack.enter_context(
            Trainer(0, 1, socket=c.daemons[0].socket, job="wide", timeout_s=15)
        )
        engines = []
        for r in range(3):
            eng = Engine(r, 3, socket=c.daemons[r + 1].socket, job="wide", timeout_s=15)
            stack.enter_context(eng)
            eng.register({n: torch.zeros(4) for n in names[r * 1000 : (r + 1) * 1000]})
            engines.append(eng)
        tr.register({n: torch.full((4,), float(i)) for i, n in enumerate(names)})
        t0 = time.monotonic()
        with pytest.raises(WeightwireError) as told:
            tr.publish(1)
        assert time.monotonic() - t0 < 10, "left to its timeout"
        assert told.value.code is ErrorCode.TOO_LARGE, told.value
        assert "plan of job 'wide' for host0" in told.value.message, told.value
        assert "max_message_bytes" in told.value.message, told.value
        with pytest.raises(WeightwireError) as waited:
            engines[0].wait(1, timeout_s=15)
        assert waited.value.code is ErrorCode.TOO_LARGE, waited.value
