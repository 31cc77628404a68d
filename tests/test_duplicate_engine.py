"""An engine rank claimed twice: a second process registers the same job's engine rank
behind another host's daemon while the first one receives. (An elastic replica claimed
twice keeps serving and only the claimant is refused: test_replica_claims.py.)

The job cannot be planned while both claim it (which one is right is not weightwire's to
guess), and every rank hears why at once: the trainer's publish, and an engine rank's wait
already under way, raise a `duplicate` error naming the rank and both hosts. The trainer
used to go on publishing on the withdrawn plan, and the engine host refused its writes as
`unauthorized` ("host0 is not a planned source of region 1"), an error not to retry that
named nothing of the cause; and a wait under way ran to its timeout ("no writes"). Once
the second claim is gone, the job is planned again and the first rank gets the next
version bitwise; nothing it held was lost. Real daemons, each host in its own network
namespace."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError, retryable

from .conftest import FAST, NETNS, NETNS_WHY, serve

pytestmark = pytest.mark.skipif(not NETNS, reason=f"needs namespaces: {NETNS_WHY}")


@pytest.fixture(scope="module")
def three() -> Iterator[LocalCluster]:
    """host0 coordinates and trains, host1 and host2 run engine ranks."""
    yield from serve(LocalCluster(hosts=3, use_netns=True, extra=FAST))


def test_an_engine_rank_claimed_twice_is_named_and_the_first_gets_the_next_version(
    three: LocalCluster,
) -> None:
    c = three
    job = "claimed-twice"
    w = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros_like(w)
    eng = Engine(0, 1, socket=c.daemons[1].socket, job=job, timeout_s=10)
    tr = Trainer(0, 1, socket=c.daemons[0].socket, job=job, timeout_s=10)
    twin = None
    try:
        eng.register({"w": dst})
        tr.register({"w": w})
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, w)
        waited: dict[str, object] = {}

        def wait() -> None:
            t0 = time.monotonic()
            try:
                waited["done"] = eng.wait(2, timeout_s=30)
            except WeightwireError as exc:
                waited["error"] = exc
            waited["s"] = time.monotonic() - t0

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)  # the wait is under way at the engine's daemon
        twin = Engine(0, 1, socket=c.daemons[2].socket, job=job, timeout_s=10)
        twin.register({"w": torch.zeros_like(w)})
        waiter.join(40)
        error = waited.get("error")
        assert isinstance(error, WeightwireError), waited
        assert error.code is ErrorCode.DUPLICATE and "host2" in error.message, error
        assert float(waited["s"]) < 15, waited  # told, not left to its timeout
        w.add_(1)
        with pytest.raises(WeightwireError) as perr:
            tr.publish(2)
        assert perr.value.code is ErrorCode.DUPLICATE, perr.value
        assert "engine rank 0 on host1 and host2" in perr.value.message, perr.value
        assert not retryable(perr.value)
        assert torch.equal(dst, w - 1), "a byte of the refused version landed"
        twin.close()
        twin = None
        deadline = time.monotonic() + 20
        while True:  # the twin's session ends, host2 advertises without it, a plan comes
            try:
                tr.publish(3)
                break
            except WeightwireError as exc:
                assert exc.code is ErrorCode.DUPLICATE, exc
                assert time.monotonic() < deadline, "no plan after the twin left"
                time.sleep(0.2)
        eng.wait(3)
        assert torch.equal(dst, w)
    finally:
        for x in (twin, tr, eng):
            if x is not None:
                x.close()
