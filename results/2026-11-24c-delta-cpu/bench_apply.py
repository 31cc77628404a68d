"""The engine's apply of one bucket alone: a 256 MiB bucket (two 128 MiB tensors) of bf16
at 4.2 % density, one BLOCK16 payload, through `DeltaReceiver.apply_bucket` (checks,
scatter, each range's xxh3): the compiled host apply (`hostapply`) against the decode +
numpy scatter + xxh3 after (the path taken without numba), in one process, best of 5,
both checked bitwise and against xxh3 of the new bytes.

    .venv/bin/python results/2026-11-24c-delta-cpu/bench_apply.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from weightwire.client.delta import codec, digest, frames, receiver
from weightwire.protocol.local import ApplyBucket

N = 256 << 20
rng = np.random.default_rng(0)
new = torch.from_numpy(rng.integers(0, 256, N, dtype=np.uint8))
dst = new.clone()
hit = rng.random(N // 2) < 0.042
dst.numpy().view(np.uint16)[hit] ^= 1
old = dst.clone()
n = N // 2
pos = torch.from_numpy(np.flatnonzero(hit).astype(np.int64))
body = codec.encode_body(pos, codec.values_at(new, pos, 2), n, 2, codec.Kind.BLOCK16)
half = N // 2
blocks = ((0, 0, half, 1, 0), (0, half, half, 1, 0))
head = frames.PayloadHead(int(codec.Kind.BLOCK16), 2, 1, 0, n, pos.numel(), body.numel(), blocks)
area = torch.zeros(head.size, dtype=torch.uint8)
area[: head.body_offset] = torch.frombuffer(bytearray(frames.payload_head(head)), dtype=torch.uint8)
area[head.body_offset :] = body
rx = receiver.DeltaReceiver(0, area)
rx.add_targets(
    [receiver.Target(0, 0, half, dst[:half]), receiver.Target(0, half, half, dst[half:])]
)
want = {r: digest.xdigest([new[r[1] : r[1] + r[2]]]) for r in blocks}


def best(compiled: bool) -> float:
    rx._host_only = (lambda b: True) if compiled else (lambda b: False)  # type: ignore[method-assign]
    times = []
    for rep in range(5):
        dst.copy_(old)
        rx._early, rx._settled, rx.held = None, -1, 0
        msg = ApplyBucket(
            rank=0, version=1, region=1, sender=0, bucket=rep, ranges=blocks,
            payloads=((0, head.size),),
        )  # fmt: skip
        t = time.perf_counter()
        rx.apply_bucket(msg)
        times.append(time.perf_counter() - t)
        early = rx._early
        assert early is not None and early.error is None, early
        assert torch.equal(dst, new)
        assert {r: early.sums[(0, r)] for r in blocks} == want
    return min(times)


ref, fused = best(False), best(True)
print(f"apply_bucket, 256 MiB at 4.2 %: decode + scatter + xxh3 {ref * 1e3:.1f} ms, "
      f"compiled host apply {fused * 1e3:.1f} ms ({ref / fused:.2f}x)")  # fmt: skip
