"""Boxes from DTensor placements (`client.modules`), and registration errors: a placement
that is no box of the global tensor raises RegistrationError naming the parameter and the
placement, and nothing reaches the daemon (the same rank then registers and publishes the
rest bitwise through real daemons)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from weightwire.client import Engine, Trainer
from weightwire.client.modules import Unexpressible, dtensor_box, strip_wrappers
from weightwire.harness.localcluster import LocalCluster
from weightwire.protocol.errors import ErrorCode, RegistrationError

pytestmark = pytest.mark.fsdp2


def box(shape, mesh, coord, placements):  # type: ignore[no-untyped-def]
    b = dtensor_box(shape, mesh, coord, placements)
    return list(zip(b.offsets, b.sizes, strict=True))


def test_shard_is_torch_chunk_with_uneven_and_empty_last_shards() -> None:
    got = [box((5, 3), (4,), (i,), [Shard(0)]) for i in range(4)]
    assert got == [[(0, 2), (0, 3)], [(2, 2), (0, 3)], [(4, 1), (0, 3)], [(0, 0), (0, 3)]]


def test_hsdp_replicas_hold_the_same_box() -> None:
    placements = [Replicate(), Shard(0)]
    for shard in range(2):
        a = box((7, 2), (2, 2), (0, shard), placements)
        assert a == box((7, 2), (2, 2), (1, shard), placements)
    assert box((7, 2), (2, 2), (1, 1), placements) == [(4, 3), (0, 2)]


def test_two_dimensional_meshes() -> None:
    # FSDP over row-parallel TP: rows by FSDP, columns by TP
    assert box((5, 10), (2, 2), (1, 1), [Shard(0), Shard(1)]) == [(3, 2), (5, 5)]
    # FSDP over column-parallel TP (right to left on dim 0): TP halves, then FSDP chunks
    strided = [_StridedShard(0, split_factor=2), Shard(0)]
    rows = [box((11, 4), (2, 2), (d, t), strided)[0] for d in range(2) for t in range(2)]
    assert rows == [(0, 3), (6, 3), (3, 3), (9, 2)]  # TP [0, 6) [6, 11), FSDP 3+3, 3+2


def test_unexpressible_placements() -> None:
    with pytest.raises(Unexpressible, match="Partial"):
        dtensor_box((4,), (2,), (0,), [Partial()])
    with pytest.raises(Unexpressible, match="rows 0:3, 5:8 of dimension 0"):
        dtensor_box((10,), (2, 2), (0, 0), [_StridedShard(0, split_factor=2), Replicate()])
    with pytest.raises(Unexpressible, match="dimension 2 of a 2-D"):
        dtensor_box((4, 4), (2,), (0,), [Shard(2)])


def test_wrapper_parts_are_stripped() -> None:
    assert strip_wrappers("_orig_mod.model._checkpoint_wrapped_module.mlp.weight") == (
        "model.mlp.weight"
    )


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_partial_parameter_is_refused_and_nothing_is_sent(
    cluster: LocalCluster, one_rank_group: None
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    good = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    model = torch.nn.Module()
    model.good = torch.nn.Parameter(DTensor.from_local(good.clone(), mesh, [Shard(0)]))
    model.bad = torch.nn.Parameter(DTensor.from_local(torch.ones(3, 4), mesh, [Partial()]))
    job = "modules-refused"
    dst = torch.zeros(3, 4)
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    eng.register({"good": dst})
    with Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30) as tr:
        with pytest.raises(RegistrationError) as err:
            tr.register_module(model)
        assert err.value.code == ErrorCode.INVALID
        assert "parameter bad" in err.value.message and "Partial" in err.value.message
        # nothing was declared: `good` registers now (a duplicate would be refused by the
        # daemon) and is the only source of the plan (`bad` would be an unused source)
        assert tr.register_module(model, rename=lambda n: None if n == "bad" else n) == {
            "good": ((0, 0), (3, 4))
        }
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, good)
    eng.close()


def test_tensors_whose_bytes_are_not_their_values_are_refused(
    cluster: LocalCluster, one_rank_group: None
) -> None:
    """A DTensor given to `register` (its shape is the global one, its bytes are elsewhere)
    and a tensor subclass with no storage of its own (as float8 training wrappers are), as
    a tensor, a module parameter or an engine tensor: a typed error naming it, nothing
    declared. They used to be registered (address 0): on the CPU torch's copies packed what
    the subclass made of them (TwoTensor: its second tensor), and on a GPU the packing
    kernels, which read memory by address, would have read from address 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.two_tensor import TwoTensor

    mesh = init_device_mesh("cpu", (1,))
    good = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    two = TwoTensor(good.clone(), good * 2)
    model = torch.nn.Module()
    model.two = torch.nn.Parameter(TwoTensor(good.clone(), good * 2), requires_grad=False)
    job = "storageless"
    eng = Engine(0, 1, socket=cluster.daemons[1].socket, job=job, timeout_s=30)
    with Trainer(0, 1, socket=cluster.daemons[0].socket, job=job, timeout_s=30) as tr:
        for call, named in (
            (lambda: tr.register({"w": DTensor.from_local(good, mesh, [Shard(0)])}), "DTensor"),
            (lambda: tr.register({"w": two}), "w is a TwoTensor"),
            (lambda: tr.register_module(model), "parameter two is a TwoTensor"),
            (lambda: eng.register({"w": two}), "w is a TwoTensor"),
        ):
            with pytest.raises(RegistrationError) as err:
                call()
            assert err.value.code == ErrorCode.INVALID and named in err.value.message
        dst = torch.zeros(3, 4)
        eng.register({"w": dst})
        tr.register({"w": good})  # nothing was declared before: no duplicate
        tr.publish(1)
        eng.wait(1)
        assert torch.equal(dst, good)
    eng.close()
