"""What a tensor is, what part of it a rank holds, and how destination bytes are made.

A *box* is a rectangular slice of a tensor: per dimension an offset and a size.
A trainer rank holds a box of each global (logical, unsharded) tensor. A
destination tensor is described by a *recipe*: an ordered list of pieces, each
"this box of source tensor S, transformed, lands at this byte offset".
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]

DType = Literal[
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
]

ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


MAX_ELEMENTS = 1 << 48
"""The most elements a tensor may have (256 Ti): far beyond any model's, and small enough
that byte sizes and offsets stay exact 64-bit integers everywhere."""


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    """Raise ValueError (a validation error when decoding) for a shape too large to be real."""
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(
            f"tensor {name!r} of shape {list(shape)} has {math.prod(shape)} elements, more "
            f"than the limit of 2^48"
        )


class Box(msgspec.Struct, frozen=True, kw_only=True):
    """A rectangular slice: `offsets[d] : offsets[d] + sizes[d]` on every dimension d."""

    offsets: tuple[NonNeg, ...]
    sizes: tuple[NonNeg, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls(offsets=(0,) * len(shape), sizes=tuple(shape))

    @classmethod
    def rows(cls, shape: tuple[int, ...], start: int, stop: int, dim: int = 0) -> Box:
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim] = start
        sizes[dim] = stop - start
        return cls(offsets=tuple(offsets), sizes=tuple(sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def within(self, shape: tuple[int, ...]) -> bool:
        return len(self.offsets) == len(shape) == len(self.sizes) and all(
            o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        )

    def intersect(self, other: Box) -> Box | None:
        offs: list[int] = []
        sizes: list[int] = []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(offsets=tuple(offs), sizes=tuple(sizes))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of `outer` (which must contain it)."""
        return Box(
            offsets=tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)),
            sizes=self.sizes,
        )


class Copy(msgspec.Struct, frozen=True, tag="copy"):
    """The box's elements as they are."""


class Cast(msgspec.Struct, frozen=True, tag="cast"):
    """The box's elements converted to `dtype` (round to nearest even)."""

    dtype: DType


class Fp8BlockQuant(msgspec.Struct, frozen=True, tag="fp8_quant"):
    """float8_e4m3fn codes of a 2-D box, each `block`x`block` tile scaled by its amax/448."""

    block: BlockSize = 128
    dtype: DType = "float8_e4m3fn"


class Fp8BlockScale(msgspec.Struct, frozen=True, tag="fp8_scale"):
    """The float32 inverse scales (amax/448) of the tiles `Fp8BlockQuant` produces."""

    block: BlockSize = 128


class Zeros(msgspec.Struct, frozen=True, tag="zeros"):
    """Bytes the engine keeps at zero (e.g. vocabulary padding): covered, never sent.

    The piece's `source` is empty and its `box` only gives the shape of the zero block.
    """

    dtype: DType


Transform = Copy | Cast | Fp8BlockQuant | Fp8BlockScale | Zeros


class Piece(msgspec.Struct, frozen=True, kw_only=True):
    """`box` of global source tensor `source`, transformed, at byte `dst_offset` of the tensor."""

    source: Annotated[str, msgspec.Meta(max_length=1024)]  # empty only for Zeros
    box: Box
    dst_offset: NonNeg
    transform: Transform = Copy()

    @property
    def sent(self) -> bool:
        """Whether any bytes of this piece travel (Zeros pieces stay on the engine)."""
        return not isinstance(self.transform, Zeros)


class SourceTensor(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor a trainer rank holds: the global tensor's name, dtype, shape, and its box."""

    name: Name
    dtype: DType
    shape: tuple[NonNeg, ...]
    box: Box | None = None  # None: the whole tensor
    region: int = -1  # a region of the rank where the held bytes live (row-major): zero-copy
    offset: NonNeg = 0  # byte offset of the held box in that region

    def __post_init__(self) -> None:
        check_shape(self.name, self.shape)

    def held(self) -> Box:
        return self.box if self.box is not None else Box.full(self.shape)


class DestTensor(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor an engine rank receives into: its place in a region and its recipe."""

    name: Name
    dtype: DType
    shape: tuple[NonNeg, ...]
    region: NonNeg
    offset: NonNeg
    pieces: tuple[Piece, ...] | None = None  # None: the coordinator derives them by rules

    def __post_init__(self) -> None:
        check_shape(self.name, self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def transformed_itemsize(source_dtype: str, transform: Transform) -> int:
    match transform:
        case Copy():
            return ITEMSIZE[source_dtype]
        case Cast(dtype=dtype) | Fp8BlockQuant(dtype=dtype) | Zeros(dtype=dtype):
            return ITEMSIZE[dtype]
        case Fp8BlockScale():
            return 4


def piece_nbytes(source_dtype: str, piece: Piece) -> int:
    """Bytes a piece occupies at its destination."""
    match piece.transform:
        case Fp8BlockScale(block=b):
            rows, cols = piece.box.sizes[-2], piece.box.sizes[-1]
            lead = math.prod(piece.box.sizes[:-2])
            return lead * (-(-rows // b)) * (-(-cols // b)) * 4
        case t:
            return piece.box.numel * transformed_itemsize(source_dtype, t)
