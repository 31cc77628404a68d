"""A bucket's batched packing (`BucketPack`) is kept between publishes only while it is
valid: the same tensor objects at the same addresses. A tensor given new storage, or
another tensor under the same name, is packed from where it is now (staging checked
bitwise)."""

from __future__ import annotations

import torch

from weightwire.client.pack import Packer
from weightwire.protocol.plan import PackOp
from weightwire.protocol.tensors import Box, Copy


def _ops(names: list[str], shape: tuple[int, int]) -> tuple[PackOp, ...]:
    nbytes = shape[0] * shape[1] * 4
    return tuple(
        PackOp(source=n, box=Box.full(shape), transform=Copy(), staging_offset=i * nbytes,
               nbytes=nbytes)
        for i, n in enumerate(names)
    )  # fmt: skip


def _staged(staging: torch.Tensor, i: int, shape: tuple[int, int]) -> torch.Tensor:
    n = shape[0] * shape[1] * 4
    return staging[i * n : (i + 1) * n].view(torch.float32).view(shape)


def test_a_bucket_is_packed_from_where_its_tensors_are_now() -> None:
    shape = (8, 16)
    names = [f"t{i}" for i in range(5)]
    tensors = {n: torch.full(shape, float(i)) for i, n in enumerate(names)}
    ops = _ops(names, shape)
    staging = torch.zeros(len(names) * shape[0] * shape[1] * 4, dtype=torch.uint8)
    packer = Packer()

    packer.pack_bucket(ops, tensors, staging)
    for i, n in enumerate(names):
        assert torch.equal(_staged(staging, i, shape), tensors[n])

    tensors["t1"].fill_(11.0)  # in place: the kept pack reads the same memory
    packer.pack_bucket(ops, tensors, staging)
    assert torch.equal(_staged(staging, 1, shape), torch.full(shape, 11.0))
    assert len(packer._buckets) == 1

    kept = packer._buckets[id(ops)]
    tensors["t2"].data = torch.full(shape, 22.0)  # the same object on new storage
    packer.pack_bucket(ops, tensors, staging)
    assert packer._buckets[id(ops)] is not kept
    assert torch.equal(_staged(staging, 2, shape), torch.full(shape, 22.0))

    kept = packer._buckets[id(ops)]
    swapped = dict(tensors, t3=torch.full(shape, 33.0))  # another object under t3's name
    packer.pack_bucket(ops, swapped, staging)
    assert packer._buckets[id(ops)] is not kept
    assert torch.equal(_staged(staging, 3, shape), torch.full(shape, 33.0))
    for i in (0, 4):
        assert torch.equal(_staged(staging, i, shape), torch.full(shape, float(i)))
