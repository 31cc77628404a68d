"""The engine's host buckets applied beside each other (client/delta/receiver.py): a bucket
that lands while the one before is being applied goes beside it (the one before on the
helper thread, this one on the notifier's: two at most), and never beside a bucket of
another version (one that never ended here may still be
writing on the helper). The buckets here carry no payloads: what is checked is when each
bucket's apply runs, against the others'."""

from __future__ import annotations

import threading
import time

import torch

from weightwire.client.delta.receiver import DeltaReceiver
from weightwire.protocol.local import ApplyBucket


def bucket(version: int, index: int) -> ApplyBucket:
    return ApplyBucket(rank=0, version=version, region=0, sender=0, bucket=index)


class Timed:
    """Wraps a receiver's per-bucket apply: (version, bucket, start, end) of each, the first
    one held until `release` is set."""

    def __init__(self, rx: DeltaReceiver) -> None:
        self.spans: list[tuple[int, int, float, float]] = []
        self.calls = 0
        self.release = threading.Event()
        self._inner = rx._apply_bucket
        rx._apply_bucket = self  # type: ignore[method-assign,assignment]

    def __call__(self, early, msg) -> None:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        self.calls += 1
        if self.calls == 1:
            assert self.release.wait(10)
        self._inner(early, msg)
        self.spans.append((msg.version, msg.bucket, start, time.monotonic()))


def test_a_second_bucket_goes_beside_the_first() -> None:
    rx = DeltaReceiver(0, torch.zeros(4096, dtype=torch.uint8))
    timed = Timed(rx)
    rx.apply_bucket(bucket(1, 0))  # on the helper, held there
    rx.apply_bucket(bucket(1, 1))  # beside it, here: returns while bucket 0 is held
    assert [s[1] for s in timed.spans] == [1]
    timed.release.set()
    rx.wait_buckets()
    assert sorted(s[1] for s in timed.spans) == [0, 1]
    rx.close()


def test_a_new_version_never_goes_beside_the_last_ones_bucket() -> None:
    rx = DeltaReceiver(0, torch.zeros(4096, dtype=torch.uint8))
    timed = Timed(rx)
    rx.apply_bucket(bucket(1, 0))  # version 1's bucket, held on the helper; no ApplyVersion
    later = threading.Thread(target=rx.apply_bucket, args=(bucket(2, 0),))
    later.start()
    time.sleep(0.3)
    assert not timed.spans, "version 2's bucket was applied while version 1's was held"
    timed.release.set()
    later.join(10)
    rx.wait_buckets()
    (v1, _, _, end1), (v2, _, start2, _) = sorted(timed.spans, key=lambda s: s[0])
    assert (v1, v2) == (1, 2) and start2 >= end1
    rx.close()
