"""What feeds an engine's destination tensor (`Engine.register`'s `sources`): the whole
source tensor of its name, `Rows` of one, explicit pieces (`Recipe`), or the coordinator's
rules (a layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import EngineLayout
from weightwire.protocol.tensors import Box, Piece


@dataclass(frozen=True)
class Rows:
    """The destination is rows [start, stop) (dim 0) of a global tensor of `shape`."""

    shape: tuple[int, ...]
    start: int
    stop: int

    def pieces(self, name: str, dtype_size: int) -> tuple[Piece, ...]:
        return (Piece(source=name, box=Box.rows(self.shape, self.start, self.stop), dst_offset=0),)


@dataclass(frozen=True)
class Recipe:
    """Explicit pieces (see weightwire.protocol.tensors.Piece)."""

    pieces: tuple[Piece, ...]


Source = Rows | Recipe


def pieces_of(
    name: str, t: torch.Tensor, source: Source | None, layout: EngineLayout | None
) -> tuple[Piece, ...] | None:
    """The pieces that feed destination tensor `name` (`t`): by `source`, or (None) the
    whole source tensor of the same name, or (None with a `layout`) the coordinator's
    rules."""
    match source:
        case Rows():
            if not (source.shape and 0 <= source.start <= source.stop <= source.shape[0]):
                raise RegistrationError(
                    f"tensor {name}: rows {source.start}:{source.stop} are not rows of "
                    f"{list(source.shape)}",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            if source.stop - source.start != t.shape[0] or source.shape[1:] != t.shape[1:]:
                raise RegistrationError(
                    f"tensor {name} {list(t.shape)} is not rows {source.start}:{source.stop} "
                    f"of {list(source.shape)}",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            return source.pieces(name, t.element_size())
        case Recipe(pieces=pieces):
            return pieces
        case None if layout is not None:
            return None
        case None:
            return (Piece(source=name, box=Box.full(tuple(t.shape)), dst_offset=0),)
        case _:  # it used to mean "the coordinator's rules", as None with a layout does
            raise RegistrationError(
                f"tensor {name}: source {source!r} is no Rows(shape, start, stop) or "
                "Recipe(pieces)",
                code=ErrorCode.INVALID,
            )
