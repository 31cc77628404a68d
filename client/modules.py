"""A torch module's parameters as this rank holds them: for each, its HF name, its local
tensor and the box of the global tensor that local tensor is (`Trainer.register_module`).

FSDP2 (`fully_shard`) parameters are DTensors: a device mesh and one placement per mesh
dimension. The box is read from them the way DTensor lays shards out:

- `Shard(d)`: the mesh dimension cuts tensor dimension d as `torch.chunk` does (the last
  shards smaller, or empty, when it does not divide);
- `Replicate()`: every coordinate of the mesh dimension holds the same box (HSDP's
  replica dimension; a TP dimension for a parameter FSDP shards alone). Every replica
  registers it, and the planner gives each piece (cut to at most a bucket) to the
  least-loaded rank holding it, so the replicas share the sends; to send from one replica
  only, create Trainers on its ranks only;
- `_StridedShard(d, sf)` (FSDP2 over TP on the same tensor dimension): the dimension is cut
  into `sf` pieces first, each piece is chunked over the mesh dimension, and the rank holds
  its chunk of every piece, in order.

Several mesh dimensions apply left to right. A placement that is not one of these
(`Partial`: the values are not the weights yet), or a combination whose shard is not one
rectangular box of the global tensor, raises `RegistrationError` naming the parameter and
its placements; nothing is registered then. Plain (non-DTensor) parameters are whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.tensors import Box

from .inputs import storageless

Rename = Callable[[str], str | None]
"""Parameter name (torch's wrapper parts already removed) -> HF name, or None: leave it out."""

WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""Name parts torch's wrappers add (torch.compile, FSDP1, activation checkpointing)."""


def strip_wrappers(name: str) -> str:
    for part in WRAPPERS:
        name = name.replace(part, "")
    return name


class Unexpressible(ValueError):
    """A placement, or a combination of them, that gives no box of the global tensor."""


Ranges = list[tuple[int, int]]  # [start, stop) runs of indices, in the order held


def _take(ranges: Ranges, start: int, stop: int) -> Ranges:
    """Elements start..stop of the sequence the runs make, as runs."""
    out: Ranges = []
    seen = 0
    for lo, hi in ranges:
        a, b = max(lo, lo + start - seen), min(hi, lo + stop - seen)
        if a < b:
            out.append((a, b))
        seen += hi - lo
    return out


def _chunk(ranges: Ranges, count: int, index: int) -> Ranges:
    """Chunk `index` of `count` of the sequence, with torch.chunk's sizes."""
    n = sum(hi - lo for lo, hi in ranges)
    step = -(-n // count)
    start = min(n, index * step)
    return _take(ranges, start, min(n, start + step))


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _strided_type() -> type | None:
    from torch.distributed.tensor import placement_types

    return getattr(placement_types, "_StridedShard", None)


def dtensor_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> Box:
    """The box of the global tensor (of `shape`) held at `coordinate` of a mesh of
    `mesh_shape`, under `placements` (one per mesh dimension). Raises Unexpressible."""
    strided = _strided_type()
    ndim = len(shape)
    held: list[Ranges] = [[(0, n)] for n in shape]
    for mesh_dim, p in enumerate(placements):
        count, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        is_strided = strided is not None and isinstance(p, strided)
        if p.is_replicate():
            continue
        if not (is_strided or p.is_shard()):
            raise Unexpressible(f"{p!r} on mesh dimension {mesh_dim} is not a part of the weights")
        d = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= d < ndim:
            raise Unexpressible(f"{p!r} shards dimension {p.dim} of a {ndim}-D tensor")
        if is_strided:
            pieces = [_chunk(held[d], p.split_factor, j) for j in range(p.split_factor)]
            held[d] = _merge([r for piece in pieces for r in _chunk(piece, count, index)])
        else:
            held[d] = _chunk(held[d], count, index)
    offsets, sizes = [], []
    for d, runs in enumerate(held):
        if len(runs) > 1:
            where = ", ".join(f"{lo}:{hi}" for lo, hi in runs)
            raise Unexpressible(
                f"the shard holds rows {where} of dimension {d}: not one box of the tensor"
            )
        lo, hi = runs[0] if runs else (0, 0)  # an empty shard (uneven sharding)
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(offsets=tuple(offsets), sizes=tuple(sizes))


@dataclass
class ModuleShard:
    name: str  # HF name
    param: torch.Tensor  # the parameter (a DTensor under FSDP2)
    local: torch.Tensor  # what this rank holds of it
    shape: tuple[int, ...]  # the global tensor's
    box: Box


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a parameter (a DTensor's local shard), without autograd."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return param.to_local() if isinstance(param, DTensor) else param.detach()


def module_shards(module: torch.nn.Module, rename: Rename | None = None) -> list[ModuleShard]:
    """Each parameter this rank holds a part of, with its HF name and box; parameters
    left out by `rename`, and empty shards (uneven sharding), are not listed. Raises
    RegistrationError naming every parameter that cannot be expressed."""
    from torch.distributed.tensor import DTensor

    out: list[ModuleShard] = []
    problems: list[str] = []
    names: dict[str, str] = {}
    for pname, p in module.named_parameters():
        base = strip_wrappers(pname)
        name = rename(base) if rename is not None else base
        if name is None:
            continue
        if name in names:
            problems.append(f"parameters {names[name]} and {pname} are both named {name}")
            continue
        names[name] = pname
        shape = tuple(int(n) for n in p.shape)
        if not isinstance(p, DTensor):
            if (why := storageless(local_of(p))) is not None:
                problems.append(f"parameter {pname} {why}")
                continue
            out.append(ModuleShard(name, p, local_of(p), shape, Box.full(shape)))
            continue
        mesh, placements = p.device_mesh, tuple(p.placements)
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            continue  # this rank is not in the parameter's mesh: it holds none of it
        desc = f"placements {list(placements)} over mesh {tuple(mesh.shape)}"
        try:
            box = dtensor_box(shape, tuple(mesh.shape), coordinate, placements)
        except Unexpressible as exc:
            problems.append(f"parameter {pname} ({desc}): {exc}")
            continue
        local = local_of(p)
        if (why := storageless(local)) is not None:
            problems.append(f"parameter {pname} ({desc}): its local tensor {why}")
            continue
        if tuple(local.shape) != tuple(box.sizes):
            problems.append(
                f"parameter {pname} ({desc}): its local tensor is {list(local.shape)}, but "
                f"those placements give {list(box.sizes)} at mesh coordinate {list(coordinate)}"
            )
            continue
        if local.numel():
            out.append(ModuleShard(name, p, local, shape, box))
    if problems:
        raise RegistrationError(
            "cannot register the module (nothing was registered):\n  " + "\n  ".join(problems),
            code=ErrorCode.INVALID,
        )
    return out
