"""Version numbers used again by a new trainer process, with real daemons: a trainer rank
that went away after its versions completed comes back (no shadow), resumed from an
earlier checkpoint, and publishes a version number the engine rank already holds or has
passed, as an RL job restarted from its last checkpoint would number its steps.

Before, the engine rank's daemon took the start of a version it had settled as a late
note and ignored it: in a delta-capable job the publish waited out its whole timeout (300 s
by default) for a verdict that never came, while its dense bytes overwrote the engine's
weights; in a dense job it returned ok on the earlier completion, the engine's weights
overwritten with no version event. Now the rank's daemon remembers the last version the
rank's earlier session began on the same plan and refuses anything not after it
(`version_backwards`, naming the version to use) before a byte moves; the next version
after it goes through, dense, then deltas again, every version bitwise."""

from __future__ import annotations

import time

import pytest

from weightwire.client import Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError

from .test_delta_e2e import Pair, bitwise, cluster, step

__all__ = ["cluster"]


@pytest.mark.parametrize("mode", ["delta", "dense"])
@pytest.mark.parametrize("resume", [2, 1], ids=["same-version", "older-version"])
def test_new_trainer_resumed_from_a_checkpoint(
    cluster: LocalCluster, resume: int, mode: str
) -> None:
    p = Pair(cluster, mode="on" if mode == "delta" else "off")
    try:
        saved = {}
        for v in range(3):
            if v:
                step(p.w, 0.02, v)
            if v == resume:
                saved = {n: t.clone() for n, t in p.w.items()}  # the checkpoint
            p.tr.publish(v)
            p.eng.wait(v)
        held = {n: t.clone() for n, t in p.dst.items()}  # version 2, as the engine holds it
        p.tr.close()  # the trainer goes; a new process resumes from the checkpoint
        for n, t in p.w.items():
            t.copy_(saved[n])
        step(p.w, 0.01, 100)  # and trains a little differently
        p.tr = Trainer(
            0, 1, socket=p.c.daemons[0].socket, job=p.job, timeout_s=30,
            delta="on" if mode == "delta" else "off",
        )  # fmt: skip
        p.tr.register(p.w)
        t0 = time.monotonic()
        with pytest.raises(WeightwireError) as err:
            p.tr.publish(resume)  # a version number the engine has settled
        assert err.value.code == ErrorCode.VERSION_BACKWARDS, err.value
        assert "version 3 or later" in str(err.value), err.value
        assert time.monotonic() - t0 < 10  # refused, not a timeout
        assert bitwise(p.dst, held)  # no byte of it landed
        rx = p.eng.delta
        assert rx is not None and rx.held == 2
        for v in (3, 4, 5):
            stats = p.tr.publish(v)
            p.eng.wait(v)
            assert bitwise(p.dst, p.w), f"version {v} differs"
            if v == 3 or mode == "dense":
                assert stats.delta_bytes < 4096  # the new process holds no shadow: dense
            else:
                assert stats.delta_bytes > 4096  # deltas again
            assert rx.held == v
            step(p.w, 0.02, 10 + v)
    finally:
        p.close()


def test_a_version_failed_before_the_begin_reply_is_read(cluster: LocalCluster) -> None:
    """A version can fail at once (an engine's daemon refusing it, or an abort): its result
    may reach the trainer before the BeginVersion reply is read. The publish fails with it
    at once; it waited out its whole timeout when the result came before the version was
    open here (in CI: a trainer resumed after its daemon restarted)."""
    p = Pair(cluster, mode="on")
    try:
        p.tr.publish(0)
        p.eng.wait(0)
        start = p.tr._start
        begin = start.begin

        def begin_then_fail(version, *args, **kwargs):  # type: ignore[no-untyped-def]
            begun = begin(version, *args, **kwargs)
            p.tr._abort(version, "failed while the reply was on its way")
            time.sleep(1.0)  # the result is taken on the connection's thread meanwhile
            return begun

        start.begin = begin_then_fail
        t0 = time.monotonic()
        with pytest.raises(WeightwireError) as err:
            p.tr.publish(1)
        assert time.monotonic() - t0 < 10, "waited out its timeout"
        assert "failed while the reply was on its way" in str(err.value), err.value
        start.begin = begin
        p.tr.publish(2)
        p.eng.wait(2)
        assert bitwise(p.dst, p.w)
    finally:
        p.close()
