"""How a trainer rank's tensor relates to the global tensor it is part of."""

from __future__ import annotations

from dataclasses import dataclass

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.tensors import Box


@dataclass(frozen=True)
class Full:
    """The rank holds the whole tensor."""

    def box(self, shape: tuple[int, ...]) -> Box:
        return Box.full(shape)


@dataclass(frozen=True)
class Shard:
    """`index`-th of `count` chunks along `dim`, with torch.chunk's sizes (FSDP, Megatron TP)."""

    dim: int
    index: int
    count: int

    def box(self, shape: tuple[int, ...]) -> Box:
        if not 0 <= self.dim < len(shape):
            raise RegistrationError(f"shard dim {self.dim} outside a {len(shape)}-D tensor")
        if not 0 <= self.index < self.count:
            raise RegistrationError(f"shard index {self.index} outside 0..{self.count - 1}")
        n = shape[self.dim]
        step = -(-n // self.count)
        start = min(n, self.index * step)
        stop = min(n, start + step)
        return Box.rows(shape, start, stop, self.dim)


@dataclass(frozen=True)
class Part:
    """An explicit box of the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def box(self, shape: tuple[int, ...]) -> Box:
        return Box(offsets=self.offsets, sizes=self.sizes)


Layout = Full | Shard | Part


def local_box(layout: Layout, global_shape: tuple[int, ...], local_shape: tuple[int, ...]) -> Box:
    box = layout.box(global_shape)
    if tuple(box.sizes) != tuple(local_shape):
        raise RegistrationError(
            f"{layout} of a {list(global_shape)} tensor is {list(box.sizes)}, but the local "
            f"tensor is {list(local_shape)}",
            code=ErrorCode.SHAPE_MISMATCH,
        )
    return box
