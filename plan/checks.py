"""Checks of a destination's recipe against what the trainers declared: every piece from a
known source, inside it, of the right dtype, and together covering the tensor exactly."""

from __future__ import annotations

from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import (
    Cast,
    Copy,
    DestTensor,
    Fp8BlockQuant,
    Fp8BlockScale,
    Piece,
    Zeros,
    piece_nbytes,
)

from .boxes import fmt_box
from .sources import SourceIndex

FP8_CODES = "float8_e4m3fn"  # the codes the packers make (`client/fp8.quantize_blocks`)


def check_destination(
    dst: DestTensor,
    regions: dict[int, RegionDescriptor],
    index: SourceIndex,
    memo: dict[tuple[object, ...], str | None],
) -> str | None:
    if dst.pieces is None:
        return f"{dst.name} has no recipe (no rule maps it)"
    region = regions.get(dst.region)
    if region is None:
        return f"{dst.name} lies in region {dst.region}, which the rank did not register"
    if dst.offset + dst.nbytes > region.length:
        return f"{dst.name} [{dst.offset}, +{dst.nbytes}) overruns region {dst.region}"
    key = (dst.name, dst.dtype, dst.shape, dst.pieces)  # engine replicas repeat them
    if key not in memo:
        memo[key] = check_pieces(dst, index)
    return memo[key]


def check_pieces(dst: DestTensor, index: SourceIndex) -> str | None:
    """The recipe's pieces: known sources, inside them, right dtypes, covering exactly."""
    assert dst.pieces is not None
    spans: list[tuple[int, int]] = []
    for piece in dst.pieces:
        if isinstance(piece.transform, Zeros):
            if piece.transform.dtype != dst.dtype:
                return (
                    f"{dst.name}: zero padding of {piece.transform.dtype} in a {dst.dtype} tensor"
                )
            spans.append((piece.dst_offset, piece.dst_offset + piece_nbytes(dst.dtype, piece)))
            continue
        meta = index.meta.get(piece.source)
        if meta is None:
            return f"{dst.name} needs source tensor {piece.source}, which no trainer declared"
        src_dtype, src_shape = meta
        if not piece.box.within(src_shape):
            return (
                f"{dst.name} reads {piece.source}{fmt_box(piece.box)} outside its shape "
                f"{list(src_shape)}"
            )
        if isinstance(piece.transform, Fp8BlockQuant) and piece.transform.dtype != FP8_CODES:
            code = ErrorCode.DTYPE_MISMATCH.value
            return (
                f"{dst.name}: FP8 block quantization of {piece.source} to "
                f"{piece.transform.dtype}: only {FP8_CODES} codes are made [{code}]"
            )
        out_dtype = _out_dtype(src_dtype, piece)
        if out_dtype != dst.dtype:
            code = ErrorCode.DTYPE_MISMATCH.value
            return (
                f"{dst.name} is {dst.dtype} but {piece.source} ({src_dtype}) through "
                f"{type(piece.transform).__name__} gives {out_dtype} [{code}]"
            )
        spans.append((piece.dst_offset, piece.dst_offset + piece_nbytes(src_dtype, piece)))
    spans.sort()
    end = 0
    for lo, hi in spans:
        if lo != end:
            what = "overlap" if lo < end else "gap"
            return f"{dst.name}: its pieces {what} at byte {min(lo, end)} [shape_mismatch]"
        end = hi
    if end != dst.nbytes:
        return (
            f"{dst.name}: its pieces give {end} bytes, the tensor has {dst.nbytes} "
            f"({dst.dtype}{list(dst.shape)}) [shape_mismatch]"
        )
    return None


def _out_dtype(source_dtype: str, piece: Piece) -> str:
    match piece.transform:
        case Copy():
            return source_dtype
        case Cast(dtype=d) | Fp8BlockQuant(dtype=d):
            return d
        case Fp8BlockScale():
            return "float32"
        case Zeros(dtype=d):
            return d
    raise AssertionError(piece.transform)
