"""Delta sync against trainer sources that change under weightwire, with real daemons
(the layouts' helpers and cluster from `test_delta_layouts`): parameters given new storage
or passed as new tensor objects between versions, changed in place after publish returned,
tensors registered between versions (replans), fp32 master shards of two trainer ranks
cast on the way with one rank replaced, and a registered parameter given storage of
another dtype or shape, or freed, after registration (refused with a typed error before
any byte moves). Every version bitwise."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightwire.client import Engine, Recipe, Shard, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.tensors import Box, Cast, Piece

from .test_delta_layouts import Dest, E, H, I, bf16, cluster, raw, reference, step

__all__ = ["cluster"]
_jobs = itertools.count()


def test_parameter_replaced_between_versions(cluster: LocalCluster) -> None:
    """Between versions a parameter gets new storage (`param.data = ...`, as offloading
    does), another is passed to publish as a new tensor object (then not, so the
    registered one is read again), and a third is changed in place after publish
    returned: each version bitwise, deltas throughout."""
    name = f"sources{next(_jobs)}"
    g = torch.Generator().manual_seed(6)
    p = torch.nn.Parameter(bf16(g, 256, 512), requires_grad=False)
    w = {"p": p, "q": bf16(g, 256, 512), "r": bf16(g, 300, 100)}
    dst = {n: torch.zeros(tuple(t.shape), dtype=t.dtype) for n, t in w.items()}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=name, timeout_s=30, delta_area=0.5)
    eng.register(dst)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=name, timeout_s=30, delta="on")
    try:
        tr.register(w)
        tr.publish(0)
        eng.wait(0)
        assert all(torch.equal(raw(dst[n]), raw(w[n])) for n in w)
        for v in range(1, 6):
            step([p.data, w["q"], w["r"]], 0.02, v)
            given = None
            if v % 2:
                p.data = p.data.clone()  # new storage, same parameter object
                given = {"q": w["q"].clone()}
                step([given["q"]], 0.02, 100 + v)  # the version publishes this one
            stats = tr.publish(v, given)
            eng.wait(v)
            want = {**w, **(given or {})}
            for n in w:
                assert torch.equal(raw(dst[n]), raw(want[n])), f"v{v}: {n} differs"
            assert stats.delta_bytes > 4096, stats
            step([w["r"]], 0.02, 200 + v)  # after publish returned: the next one sends it
    finally:
        tr.close()
        eng.close()


def test_tensors_registered_between_versions(cluster: LocalCluster) -> None:
    """Replans between versions: the engine rank registers one more tensor (zeros: the
    engine holds a verified version, but not of these bytes) and the trainer its source,
    twice. Every version bitwise; an empty tensor and a 1-element one along."""
    name = f"sources{next(_jobs)}"
    g = torch.Generator().manual_seed(7)
    w = {
        "a": bf16(g, 512, 256),
        "b": bf16(g, 300, 200),
        "c": bf16(g, 128, 64),
        "one": bf16(g, 1),
        "empty": bf16(g, 0, 16),
    }
    dst = {n: torch.zeros(tuple(t.shape), dtype=t.dtype) for n, t in w.items()}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=name, timeout_s=30, delta_area=0.5)
    held: list[str] = ["a", "one", "empty"]
    eng.register({n: dst[n] for n in held})
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=name, timeout_s=30, delta="on")
    try:
        tr.register({n: w[n] for n in held})
        version = 0
        for v in range(7):
            if v in (2, 4):  # one more tensor at both ends
                more = "b" if v == 2 else "c"
                eng.register({more: dst[more]})
                tr.register({more: w[more]})
                held.append(more)
            if v:
                step([w[n] for n in w], 0.02, v)
            for _ in range(50):  # until the replan (with both new ends) reaches the trainer
                try:
                    stats = tr.publish(version)
                    break
                except WeightwireError as exc:  # a plan of one end alone is a PlanError
                    assert exc.code in (ErrorCode.PLAN_CHANGED, ErrorCode.PLAN), exc
                    version += 1  # versions only go forwards, failed ones included
                    time.sleep(0.1)
            else:
                raise AssertionError(f"step {v} never published")
            eng.wait(version)
            for n in held:
                assert torch.equal(raw(dst[n]), raw(w[n])), f"step {v}: {n} differs"
            if v in (1, 3, 6):
                assert stats.delta_bytes > 4096, (v, stats)
            version += 1
    finally:
        tr.close()
        eng.close()


def _swap_dtype(p: torch.nn.Parameter) -> None:
    p.data = p.data.to(torch.float16)  # same bytes per element: read raw, fp16 bits as bf16


def _swap_wider(p: torch.nn.Parameter) -> None:
    p.data = p.data.float()  # fp32 master weights swapped in


def _swap_shape(p: torch.nn.Parameter) -> None:
    p.data = p.data.t().contiguous()  # stored transposed: the box would slice other elements


def _free(p: torch.nn.Parameter) -> None:
    p.data.untyped_storage().resize_(0)  # FSDP's way of freeing a parameter's memory


def _meta(p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    return {"p": torch.empty_like(p.data, device="meta")}  # a placeholder passed to publish


@pytest.mark.parametrize("mode", ["delta", "dense"])
@pytest.mark.parametrize(
    "change, code",
    [
        (_swap_dtype, ErrorCode.DTYPE_MISMATCH),
        (_swap_wider, ErrorCode.DTYPE_MISMATCH),
        (_swap_shape, ErrorCode.SHAPE_MISMATCH),
        (_free, ErrorCode.INVALID),
        (_meta, ErrorCode.INVALID),
    ],
    ids=["fp16", "fp32", "transposed", "freed", "meta"],
)
def test_registered_parameter_changed_under_us_is_refused(
    cluster: LocalCluster,
    change: Callable[[torch.nn.Parameter], dict[str, torch.Tensor] | None],
    code: ErrorCode,
    mode: str,
) -> None:
    """A registered parameter given storage of another dtype or shape (or its storage
    freed) after registration: publish refuses it with a typed error naming it, before
    any byte moves (it used to send fp16 bits as bf16 and report the version complete,
    raise a bare RuntimeError, or crash the trainer process with SIGSEGV), and once the
    parameter is put back the next versions are bitwise, deltas again."""
    name = f"sources{next(_jobs)}"
    g = torch.Generator().manual_seed(8)
    p = torch.nn.Parameter(bf16(g, 256, 512), requires_grad=False)
    w = {"p": p, "q": bf16(g, 128, 256)}
    dst = {n: torch.zeros(tuple(t.shape), dtype=t.dtype) for n, t in w.items()}
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=name, timeout_s=30, delta_area=0.5)
    eng.register(dst)
    tr = Trainer(
        0, 1, socket=cluster.daemons[0].socket, job=name, timeout_s=30,
        delta="on" if mode == "delta" else "off",
    )  # fmt: skip
    try:
        tr.register(w)
        tr.publish(0)
        eng.wait(0)
        good = p.data.clone()
        given = change(p)
        with pytest.raises(WeightwireError) as err:
            tr.publish(1, given)
        assert err.value.code == code and "tensor p" in str(err.value), err.value
        assert eng.delta is not None and eng.delta.held == 0  # nothing of version 1 landed
        assert all(torch.equal(raw(dst[n]), raw(t)) for n, t in (("p", good), ("q", w["q"])))
        p.data = good
        for v in (2, 3):
            step([p.data, w["q"]], 0.02, v)
            stats = tr.publish(v)
            eng.wait(v)
            assert all(torch.equal(raw(dst[n]), raw(w[n])) for n in w), f"v{v} differs"
            assert (stats.delta_bytes > 4096) == (mode == "delta"), stats
    finally:
        tr.close()
        eng.close()


def test_fp32_shards_of_two_trainers_cast_into_fused_bf16(cluster: LocalCluster) -> None:
    """Two trainer ranks hold fp32 master weights, each half of every expert's rows
    (FSDP); the engine rank holds stacked bf16 w13 (gate|up) and w2, cast on the way:
    deltas compared after the cast. Updates far below a bf16 ULP for most elements.
    Between versions trainer rank 1 is replaced by a new process's worth of state (no
    shadow): it sends dense, rank 0 keeps sending deltas, every version bitwise."""
    name = f"sources{next(_jobs)}"
    g = torch.Generator().manual_seed(9)
    full = {}
    for e in range(E):
        for part, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            full[f"experts.{e}.{part}"] = torch.randn(*shape, generator=g) * 0.02
    cast = Cast(dtype="bfloat16")
    w13, w2 = [], []
    for e in range(E):
        at = e * 2 * I * H * 2
        for k, part in enumerate(("gate", "up")):
            w13.append(Piece(source=f"experts.{e}.{part}", box=Box.full((I, H)),
                             dst_offset=at + k * I * H * 2, transform=cast))  # fmt: skip
        w2.append(Piece(source=f"experts.{e}.down", box=Box.full((H, I)),
                        dst_offset=e * H * I * 2, transform=cast))  # fmt: skip
    dests = {
        "experts.w13": Dest(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), tuple(w13)),
        "experts.w2": Dest(torch.zeros(E, H, I, dtype=torch.bfloat16), tuple(w2)),
    }
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=name, timeout_s=30, delta_area=0.5)
    eng.register(
        {n: d.tensor for n, d in dests.items()}, {n: Recipe(d.pieces) for n, d in dests.items()}
    )

    def shard(rank: int) -> dict[str, torch.Tensor]:
        return {n: t.chunk(2)[rank] for n, t in full.items()}  # views of the master weights

    def trainer(rank: int) -> Trainer:
        tr = Trainer(rank, 2, socket=cluster.daemons[0].socket, job=name, timeout_s=30,
                     delta="auto")  # fmt: skip
        tr.register(shard(rank), Shard(0, rank, 2), {n: tuple(t.shape) for n, t in full.items()})
        return tr

    trs = [trainer(0), trainer(1)]
    pool = ThreadPoolExecutor(2)
    try:
        for v in range(6):
            if v:
                gen = torch.Generator().manual_seed(v)
                for t in full.values():
                    t += torch.randn(t.shape, generator=gen) * 1e-5  # mostly below bf16's ULP
            if v == 3:
                trs[1].close()
                trs[1] = trainer(1)
            for _ in range(50):
                try:
                    stats = list(pool.map(Trainer.publish, trs, [v, v]))
                    break
                except WeightwireError as exc:
                    assert exc.code in (ErrorCode.PLAN_CHANGED, ErrorCode.NOT_READY), exc
                    time.sleep(0.1)
            else:
                raise AssertionError(f"version {v} never published")
            eng.wait(v)
            for n, d in dests.items():
                assert torch.equal(raw(d.tensor), reference(d.pieces, d.tensor.nbytes, full)), (
                    f"v{v}: {n} differs"
                )
            if v:
                assert stats[0].delta_bytes > 4096, stats[0]
            if v == 3:
                assert stats[1].delta_bytes < 4096, stats[1]  # the new rank: dense
    finally:
        pool.shutdown()
        for tr in trs:
            tr.close()
        eng.close()
