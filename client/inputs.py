"""What the public calls of a rank are given, checked before anything is sent: a typed
error naming what was wrong (a list for a mapping, a numpy array for a tensor, a sparse
tensor, a version or timeout that is no number), not an AttributeError, an encoder's
TypeError or a sparse tensor accepted at registration and failing the first publish."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError, VersionError

MAX_VERSION = (1 << 63) - 1  # the protocol's versions are int64


def tensors_of(tensors: Any, what: str) -> Mapping[str, torch.Tensor]:
    """`tensors` as a mapping of str -> dense torch.Tensor; raises RegistrationError
    (`invalid`) naming the first thing that is not, in `what` (e.g. "register")."""
    if not isinstance(tensors, Mapping):
        raise RegistrationError(
            f"{what}: expected a mapping of name -> torch.Tensor, got a {type(tensors).__name__}",
            code=ErrorCode.INVALID,
        )
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise RegistrationError(
                f"{what}: tensor names are str, got {name!r} ({type(name).__name__})",
                code=ErrorCode.INVALID,
            )
        if not isinstance(t, torch.Tensor):
            raise RegistrationError(
                f"{what}: {name} is a {type(t).__module__}.{type(t).__name__}, not a torch.Tensor",
                code=ErrorCode.INVALID,
            )
        if (why := storageless(t)) is not None:
            raise RegistrationError(f"{what}: {name} {why}", code=ErrorCode.INVALID)
        if t.layout is not torch.strided:
            raise RegistrationError(
                f"{what}: {name} is a {t.layout} tensor: only dense (strided) tensors are "
                "sent (.to_dense() it)",
                code=ErrorCode.INVALID,
            )
    return tensors


def version_of(version: Any) -> int:
    """`version` as an int (numpy and torch integer scalars included); raises VersionError
    (`invalid`) for anything else, or one outside 0..2**63-1."""
    if isinstance(version, bool):
        raise VersionError(f"version {version!r} is a bool, not an int", code=ErrorCode.INVALID)
    try:
        v = operator.index(version)
    except TypeError:
        raise VersionError(
            f"version {version!r} is a {type(version).__name__}, not an int",
            code=ErrorCode.INVALID,
        ) from None
    if not 0 <= v <= MAX_VERSION:
        raise VersionError(f"version {v} is outside 0..2**63-1", code=ErrorCode.INVALID)
    return v


def timeout_of(timeout_s: Any, default: float) -> float:
    """`timeout_s` seconds (None: `default`); raises RegistrationError (`invalid`) for one
    that is no positive finite number: 0 used to mean the default (300 s unless set), and
    inf to wait for ever."""
    if timeout_s is None:
        return default
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise RegistrationError(
            f"timeout_s {timeout_s!r} is a {type(timeout_s).__name__}, not a number of seconds",
            code=ErrorCode.INVALID,
        )
    seconds = float(timeout_s)
    if not (math.isfinite(seconds) and seconds > 0):
        raise RegistrationError(
            f"timeout_s {timeout_s}: a positive, finite number of seconds",
            code=ErrorCode.INVALID,
        )
    return seconds


def index_of(value: Any, what: str) -> int:
    """`value` as an int (numpy and torch integer scalars included), or RegistrationError
    (`invalid`) naming `what` (e.g. "rank")."""
    if isinstance(value, bool):
        raise RegistrationError(f"{what} {value!r} is a bool, not an int", code=ErrorCode.INVALID)
    try:
        return operator.index(value)
    except TypeError:
        raise RegistrationError(
            f"{what} {value!r} is a {type(value).__name__}, not an int", code=ErrorCode.INVALID
        ) from None


def storageless(t: torch.Tensor) -> str | None:
    """Why `t` cannot be read as raw bytes, or None: a tensor subclass with no storage of
    its own (a DTensor, a float8 training wrapper, ...), whose values the packing kernels,
    which read memory by address, would not see. Plain tensors pass, empty ones too."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not t.numel():
        return None
    try:
        ptr = t.data_ptr()
    except RuntimeError:
        ptr = 0
    if ptr:
        return None
    kind = type(t).__name__
    if kind == "DTensor":
        return (
            "is a DTensor (its shape is the global one, its bytes are elsewhere): register "
            "the module with register_module, or its to_local() with a layout"
        )
    return (
        f"is a {kind}, a tensor subclass with no storage of its own: weightwire reads tensors "
        "as bytes; register the plain tensor it stands for"
    )
