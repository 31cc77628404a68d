"""Error codes carried on the wire, and the typed exceptions they become.

Both the daemon and the client libraries raise these; a reply of type `Error`
is turned back into the matching exception on the receiving side.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # the bytes did not decode as a message of this socket
    INVALID = "invalid"  # decoded, but a field is out of range or inconsistent
    TOO_LARGE = "too_large"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    NO_SESSION = "no_session"  # a request before HELLO
    DUPLICATE = "duplicate"
    UNKNOWN_TENSOR = "unknown_tensor"
    DTYPE_MISMATCH = "dtype_mismatch"
    SHAPE_MISMATCH = "shape_mismatch"
    VERSION_BACKWARDS = "version_backwards"
    PLAN = "plan"  # the plan cannot be made from what was registered
    PLAN_CHANGED = "plan_changed"
    NOT_READY = "not_ready"
    UNKNOWN_REGION = "unknown_region"
    OUT_OF_BOUNDS = "out_of_bounds"
    PEER_LOST = "peer_lost"
    TRANSFER = "transfer"
    ABORTED = "aborted"
    TIMEOUT = "timeout"
    UNAUTHORIZED = "unauthorized"
    NO_SPACE = "no_space"  # memory for a region could not be reserved
    CHECKSUM = "checksum"  # a destination's bytes are not what its sources wrote
    STALE_BASE = "stale_base"  # a delta against a version the destination does not hold
    BUSY = "busy"  # too many requests of one connection waiting for replies at once
    INTERNAL = "internal"


class WeightwireError(Exception):
    """Base of every error weightwire raises across a boundary."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"


class ProtocolError(WeightwireError):
    code = ErrorCode.MALFORMED


class RegistrationError(WeightwireError):
    code = ErrorCode.INVALID


class PlanError(WeightwireError):
    code = ErrorCode.PLAN


class VersionError(WeightwireError):
    code = ErrorCode.VERSION_BACKWARDS


class TransferError(WeightwireError):
    code = ErrorCode.TRANSFER


class PeerLostError(TransferError):
    code = ErrorCode.PEER_LOST


class RegionError(TransferError):
    code = ErrorCode.UNKNOWN_REGION


class TimeoutError_(WeightwireError):
    code = ErrorCode.TIMEOUT


class NoDaemonError(WeightwireError):
    """No daemon socket where a rank was told to connect: weightwired is not running on
    this host, or the path (WEIGHTWIRE_SOCKET, socket=) is wrong. Not retryable: the same
    path fails the same way until something changes."""

    code = ErrorCode.INVALID


_BY_CODE: dict[ErrorCode, type[WeightwireError]] = {
    ErrorCode.MALFORMED: ProtocolError,
    ErrorCode.INVALID: RegistrationError,
    ErrorCode.TOO_LARGE: ProtocolError,
    ErrorCode.UNSUPPORTED_PROTOCOL: ProtocolError,
    ErrorCode.NO_SESSION: ProtocolError,
    ErrorCode.DUPLICATE: RegistrationError,
    ErrorCode.UNKNOWN_TENSOR: RegistrationError,
    ErrorCode.DTYPE_MISMATCH: RegistrationError,
    ErrorCode.SHAPE_MISMATCH: RegistrationError,
    ErrorCode.VERSION_BACKWARDS: VersionError,
    ErrorCode.PLAN: PlanError,
    ErrorCode.PLAN_CHANGED: PlanError,
    ErrorCode.NOT_READY: PlanError,
    ErrorCode.UNKNOWN_REGION: RegionError,
    ErrorCode.OUT_OF_BOUNDS: RegionError,
    ErrorCode.PEER_LOST: PeerLostError,
    ErrorCode.TRANSFER: TransferError,
    ErrorCode.ABORTED: TransferError,
    ErrorCode.TIMEOUT: TimeoutError_,
    ErrorCode.UNAUTHORIZED: RegionError,
    ErrorCode.NO_SPACE: RegionError,
    ErrorCode.BUSY: ProtocolError,
    ErrorCode.INTERNAL: WeightwireError,
    ErrorCode.CHECKSUM: TransferError,
    ErrorCode.STALE_BASE: TransferError,
}


RETRYABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.PEER_LOST,
        ErrorCode.TRANSFER,
        ErrorCode.ABORTED,
        ErrorCode.TIMEOUT,
        ErrorCode.PLAN_CHANGED,
        ErrorCode.NOT_READY,
        ErrorCode.CHECKSUM,  # the engine verified nothing: the next version goes dense
        ErrorCode.STALE_BASE,
    }
)
"""Codes of failures that pass: a peer lost or hung, a failed write, a version aborted
elsewhere, a timeout, a plan being remade. Publishing again (the next version number) may
succeed. Every other code needs something changed first (registrations, the plan's
inputs, the version number, memory)."""


def retryable(exc: BaseException) -> bool:
    """Whether publishing again, unchanged but for the version number, may succeed."""
    return isinstance(exc, WeightwireError) and exc.code in RETRYABLE


def error_from_code(code: str, message: str) -> WeightwireError:
    """The exception for a wire error code; unknown codes become a plain WeightwireError."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return WeightwireError(f"{message} (unknown error code {code!r})")
    return _BY_CODE[known](message, code=known)
