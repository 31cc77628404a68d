"""Delta sync from one trainer into two TP engine ranks on one node, with real daemons.

Column-parallel tensors go sliced (each engine rank its rows), norms whole to both: the
trainer stages a norm once and writes that staging block to both engine ranks. Engine
rank 1 registers first, so it holds immediate slot 0 of its node and its delta slot
comes first in each bucket, while the bucket's writes go in engine-rank order: the
writes to rank 0 visit the blocks rank 1's payload shares with them first. That order
once put rank 1's positions out of order ("delta positions are out of range or not
increasing": the version failed and went dense; `weightwire demo --delta auto` did this
whenever its engine rank 1 happened to register first).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from weightwire.client import Engine, Rows, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.plan import Bucket

from .conftest import FAST, NETNS, serve
from .test_delta_e2e import SMALL, bitwise, step

_jobs = itertools.count()
ROWS = 512


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from serve(LocalCluster(hosts=2, use_netns=NETNS, extra={**FAST, **SMALL}))


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Layers of a column-parallel weight then a norm (several per 1 MiB bucket)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(6):
        out[f"l{layer}.up"] = (torch.randn(ROWS, 384, generator=g) * 0.02).to(torch.bfloat16)
        out[f"l{layer}.norm"] = (1 + torch.randn(2048, generator=g) * 0.02).to(torch.bfloat16)
    return out


def engine_rank(c: LocalCluster, job: str, rank: int) -> tuple[Engine, dict[str, torch.Tensor]]:
    lo, hi = rank * ROWS // 2, (rank + 1) * ROWS // 2
    tensors, sources = {}, {}
    for name, t in model().items():
        if name.endswith(".up"):
            tensors[name] = torch.zeros(hi - lo, t.shape[1], dtype=t.dtype)
            sources[name] = Rows(tuple(t.shape), lo, hi)
        else:
            tensors[name] = torch.zeros_like(t)
    eng = Engine(rank, 2, socket=c.daemons[1].socket, job=job, timeout_s=30, delta_area=0.5)
    eng.register(tensors, sources)
    return eng, tensors


def expected(w: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    lo, hi = rank * ROWS // 2, (rank + 1) * ROWS // 2
    return {n: t[lo:hi] if n.endswith(".up") else t for n, t in w.items()}


def _shared(b: Bucket) -> bool:
    """Some staging bytes of bucket b are written to both engine ranks."""
    spans: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for wr in b.writes:
        spans[wr.dst_rank] += [
            (wr.src_offset + i * wr.src_stride, wr.length) for i in range(wr.count)
        ]
    return any(a < c + m and c < a + n for a, n in spans[0] for c, m in spans[1])


@pytest.mark.parametrize("first", [1, 0], ids=["rank1-registers-first", "rank0-registers-first"])
def test_delta_to_two_tp_ranks_whatever_registers_first(cluster: LocalCluster, first: int) -> None:
    job = f"deltatp{next(_jobs)}"
    engines: dict[int, tuple[Engine, dict[str, torch.Tensor]]] = {}
    for rank in (first, 1 - first):  # registration order decides each rank's slot
        engines[rank] = engine_rank(cluster, job, rank)
    w = model()
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30, delta="auto")
    try:
        tr.register(w)
        plan = tr.prepare()
        slot_of = {wr.dst_rank: wr.slot for b in plan.buckets for wr in b.writes}
        assert slot_of[first] == 0, slot_of  # the order this test means to set up
        assert any(_shared(b) for b in plan.buckets), "no staging byte goes to both ranks"
        total = sum(t.nbytes for t in w.values())
        for v in range(4):
            if v:
                step(w, 0.02, v)
            stats = tr.publish(v)  # raises if any engine rank refused its payloads
            for rank, (eng, got) in engines.items():
                eng.wait(v)
                assert bitwise(got, expected(w, rank)), f"version {v} differs at rank {rank}"
                assert eng.delta is not None and eng.delta.held == v
            if v:
                # both engine ranks got deltas, the shared norms too: far below dense
                assert stats.delta_bytes > 4096
                assert stats.nbytes < 0.25 * 1.5 * total, (stats.nbytes, total)
    finally:
        tr.close()
        for eng, _ in engines.values():
            eng.close()
