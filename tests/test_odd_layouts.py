"""Model layouts nobody chose on purpose, through `Trainer.register_module`, the planner and
real daemons, bitwise: a transposed (non-contiguous) parameter, a view at a storage offset,
a broadcast (stride 0) parameter, a dimension of size 0, a scalar (0-d; it used to fail
planning with `internal: IndexError`), bf16 tensors of odd lengths; a vocabulary of 11
rows cut 6+5 by two trainer ranks and 4+4+3 by three engine ranks. Tied parameters and a
non-contiguous engine tensor get typed errors naming them."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from weightwire.client import Engine, Rows, Shard, Trainer
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, PlanError, RegistrationError


def odd_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(7)
    m = torch.nn.Module()
    m.transposed = torch.nn.Parameter(torch.randn(3, 5, generator=g).t())
    m.offset_view = torch.nn.Parameter(torch.randn(10, generator=g)[3:7])
    m.broadcast = torch.nn.Parameter(torch.randn(1, 8, generator=g).expand(4, 8))
    m.empty = torch.nn.Parameter(torch.zeros(0, 8))
    m.scale = torch.nn.Parameter(torch.tensor(2.5))
    m.odd_bf16 = torch.nn.Parameter(torch.randn(7, generator=g).to(torch.bfloat16))
    m.square_bf16 = torch.nn.Parameter(torch.randn(3, 3, generator=g).to(torch.bfloat16))
    m.after = torch.nn.Parameter(torch.randn(5, generator=g))
    return m


def test_odd_parameters_land_bitwise_version_after_version(cluster: LocalCluster) -> None:
    model = odd_model()
    assert not model.transposed.is_contiguous() and model.broadcast.stride(0) == 0
    params = dict(model.named_parameters())
    dst = {n: torch.full(p.shape, -1.0, dtype=p.dtype) for n, p in params.items()}
    job = "odd-params"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    with Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30) as tr:
        try:
            boxes = tr.register_module(model)
            assert boxes["scale"] == ((), ()) and boxes["empty"] == ((0, 0), (0, 8))
            eng.register(dst)
            for version in (1, 2):
                with torch.no_grad():  # in place, as an optimizer step would
                    for p in params.values():
                        if p.stride() and 0 in p.stride():
                            continue  # a broadcast parameter cannot be written in place
                        p.mul_(version + 1)
                tr.publish(version)
                eng.wait(version, timeout_s=30)
                for n, p in params.items():
                    assert torch.equal(dst[n], p.detach()), (version, n, dst[n], p)
        finally:
            eng.close()


def test_vocabulary_not_divisible_by_either_side(cluster: LocalCluster) -> None:
    """11 rows: trainer ranks hold 6 + 5 (torch.chunk), engine ranks 4 + 4 + 3; every
    engine shard is cut from both trainer shards' boundaries, bitwise."""
    vocab = torch.arange(11 * 6, dtype=torch.float32).reshape(11, 6)
    job = "odd-vocab"
    cuts = [(0, 4), (4, 8), (8, 11)]
    dsts = [torch.zeros(b - a, 6) for a, b in cuts]
    engines = []
    trainers = []
    try:
        for r, ((a, b), dst) in enumerate(zip(cuts, dsts, strict=True)):
            e = Engine(r, 3, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
            engines.append(e)
            e.register({"embed.weight": dst}, {"embed.weight": Rows((11, 6), a, b)})
        for r in range(2):
            t = Trainer(r, 2, socket=cluster.daemons[0].socket, job=job, timeout_s=30)
            trainers.append(t)
            local = vocab.chunk(2)[r].clone()
            t.register(
                {"embed.weight": local},
                layout=Shard(0, r, 2),
                global_shapes={"embed.weight": (11, 6)},
            )
        for version in (1, 2):
            for r, t in enumerate(trainers):
                t.publish(version, {"embed.weight": vocab.chunk(2)[r] * version})
            for e in engines:
                e.wait(version, timeout_s=30)
            assert torch.equal(torch.cat(dsts), vocab * version)
    finally:
        for c in (*trainers, *engines):
            c.close()


def test_tied_parameters_and_non_contiguous_destinations_are_named(
    cluster: LocalCluster,
) -> None:
    m = torch.nn.Module()
    m.embed = torch.nn.Embedding(10, 4)
    m.head = torch.nn.Linear(4, 10, bias=False)
    m.head.weight = m.embed.weight  # tied: torch lists it once, as embed.weight
    job = "odd-tied"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    with Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30) as tr:
        try:
            assert list(tr.register_module(m)) == ["embed.weight"]
            eng.register({"embed.weight": torch.zeros(10, 4), "head.weight": torch.zeros(10, 4)})
            with pytest.raises(PlanError) as err:
                tr.prepare(timeout_s=20)
            assert "head.weight" in err.value.message and "no trainer declared" in err.value.message
        finally:
            eng.close()
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job + "-2", timeout_s=30)
    try:
        with pytest.raises(RegistrationError) as err2:
            eng.register({"w": torch.zeros(5, 3).t()})
        assert err2.value.code is ErrorCode.INVALID
        assert "w must be contiguous" in err2.value.message
    finally:
        eng.close()


def test_odd_parameters_in_delta_mode(cluster: LocalCluster) -> None:
    """The same parameters beside a bf16 matrix, sent as sparse deltas after a dense
    version: a few elements change each version (the scalar, one bf16 element, every 37th
    of the matrix), bitwise, and far fewer bytes than dense move."""
    model = odd_model()
    model.big = torch.nn.Parameter((torch.randn(256, 512) * 0.02).to(torch.bfloat16))
    params = dict(model.named_parameters())
    dst = {n: torch.full(p.shape, -1.0, dtype=p.dtype) for n, p in params.items()}
    job = "odd-delta"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30, delta_area=0.5)
    tr = Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30, delta="auto")
    try:
        tr.register_module(model)
        eng.register(dst)
        dense = tr.publish(0).nbytes
        eng.wait(0, timeout_s=30)
        for version in (1, 2, 3):
            with torch.no_grad():
                model.big.view(-1)[version::37] += 0.01
                model.scale.add_(1)
                model.odd_bf16[version] += 1
            stats = tr.publish(version)
            eng.wait(version, timeout_s=30)
            for n, p in params.items():
                assert torch.equal(dst[n], p.detach()), (version, n)
            assert stats.delta_bytes > 0 and stats.nbytes < dense / 4, (stats.nbytes, dense)
    finally:
        tr.close()
        eng.close()


def test_parameters_given_new_storage_between_versions(cluster: LocalCluster) -> None:
    """`param.data` replaced between publishes (offloading, a resize by mistake): new
    storage of another stride is read where it is now, bitwise, and the rank holds the old
    storage no longer once it has published from the new one (it used to keep the storage
    it registered for ever: on a GPU, after verl's FSDP offload (`model.to`), the first copy
    of the rank's parameters stayed allocated beside the reloaded one); another shape or
    dtype is a typed error naming the tensor, and the rank publishes again once right."""
    first = np.arange(12, dtype=np.float32).reshape(3, 4)  # storage whose end we can see
    gone = weakref.ref(first)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.from_numpy(first))
    m.b = torch.nn.Parameter(torch.ones(5))
    del first
    dst = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    job = "odd-storage"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    with Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30) as tr:
        try:
            tr.register_module(m)
            eng.register(dst)
            tr.publish(1)
            eng.wait(1)
            m.w.data = torch.arange(12.0).reshape(4, 3).t() * 3  # transposed storage
            tr.publish(2)
            eng.wait(2)
            assert torch.equal(dst["w"], m.w.detach()) and torch.equal(dst["b"], m.b.detach())
            gc.collect()
            assert gone() is None, "the storage the parameter was registered with is held"
            m.w.data = torch.zeros(4, 4)
            with pytest.raises(RegistrationError) as e1:
                tr.publish(3)
            assert e1.value.code is ErrorCode.SHAPE_MISMATCH and "tensor w" in e1.value.message
            m.w.data = torch.zeros(3, 4, dtype=torch.float16)
            with pytest.raises(RegistrationError) as e2:
                tr.publish(4)
            assert e2.value.code is ErrorCode.DTYPE_MISMATCH and "tensor w" in e2.value.message
            fifth = np.arange(12, dtype=np.float32).reshape(3, 4) * 7
            m.w.data = torch.from_numpy(fifth)
            gone = weakref.ref(fifth)
            del fifth
            tr.publish(5)
            eng.wait(5)
            assert torch.equal(dst["w"], m.w.detach())
            tr.release_parameters()  # before an offload: the rank holds none of their storage
            m.w.data = m.w.detach() * 2  # offloaded (and back): the old storage is freed now
            gc.collect()
            assert gone() is None, "release_parameters kept the parameter's storage"
            with torch.no_grad():
                m.b.mul_(3)  # in place, not moved: still read where it is
            for version in (6, 7):
                tr.publish(version)
                eng.wait(version)
                assert torch.equal(dst["w"], m.w.detach()) and torch.equal(dst["b"], m.b.detach())
        finally:
            eng.close()
