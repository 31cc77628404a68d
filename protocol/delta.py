"""The delta payload body's encodings and their sizes (the wire format; no I/O, no torch).

A payload encodes `k` changed elements of an `n`-element stream of `width`-byte
elements one of these ways (`client.delta.codec` encodes and decodes them; the planner's
simulator sizes them):

- ``POS32``: the positions as uint32, then the new values;
- ``BLOCK16``: one uint32 count per 65536 elements, each position's low 16 bits, values
  (2 bytes of position per change: bf16 at density d costs ~2 d of the dense bytes);
- ``BITMAP``: one bit per element, then the values (better above ~1/(8 width) density);
- ``DENSE``: the new stream itself.
"""

from __future__ import annotations

import enum

BLOCK = 1 << 16  # elements per BLOCK16 block
WIDTHS = (1, 2, 4, 8)


class Kind(enum.IntEnum):
    DENSE = 0
    POS32 = 1
    BLOCK16 = 2
    BITMAP = 3


def elements(nbytes: int, width: int) -> int:
    if width not in WIDTHS:
        raise ValueError(f"element width {width} is not 1, 2, 4 or 8")
    if nbytes % width:
        raise ValueError(f"{nbytes} bytes are not whole elements of {width} bytes")
    return nbytes // width


def body_size(kind: Kind, n: int, k: int, width: int) -> int:
    """Bytes of a body that encodes `k` of `n` elements of `width` bytes."""
    match kind:
        case Kind.DENSE:
            return n * width
        case Kind.POS32:
            return 4 * k + k * width
        case Kind.BLOCK16:
            return 4 * (-(-n // BLOCK)) + 2 * k + k * width
        case Kind.BITMAP:
            return -(-n // 8) + k * width
    raise ValueError(f"unknown delta encoding {kind}")


SPARSE = (Kind.POS32, Kind.BLOCK16, Kind.BITMAP)  # the delta (not dense) encodings


def _sparse(n: int, kinds: tuple[Kind, ...]) -> list[Kind]:
    """Those of `kinds` a stream of n elements may use (POS32 positions are 32-bit)."""
    return [kd for kd in kinds if kd is not Kind.POS32 or n <= 0xFFFFFFFF]


def max_changes(n: int, width: int, capacity: int, kinds: tuple[Kind, ...] = SPARSE) -> int:
    """The most changes of n elements whose smallest delta body (of `kinds`) fits
    `capacity` bytes (-1: none fits); exact, so a compare may stop once it has found more."""
    best = -1
    for kind in _sparse(n, kinds):
        fixed = body_size(kind, n, 0, width)
        per = body_size(kind, n, 1, width) - fixed
        if capacity >= fixed:
            best = max(best, (capacity - fixed) // per)
    return min(best, n)


def best_kind(
    n: int, k: int, width: int, *, allow_dense: bool = True, kinds: tuple[Kind, ...] = SPARSE
) -> Kind:
    """The smallest encoding of k changes of n elements, of `kinds` or dense (ties go to
    the simplest)."""
    some = ([Kind.DENSE] if allow_dense else []) + _sparse(n, kinds)
    return min(some, key=lambda kd: body_size(kd, n, k, width))
