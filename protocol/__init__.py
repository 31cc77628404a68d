"""weightwire's wire protocol: msgspec Structs in one tagged union per socket.

A leaf package: msgspec and the standard library only.
"""

from __future__ import annotations

from .errors import ErrorCode, ProtocolError, WeightwireError, error_from_code

PROTOCOL_VERSION = 1
"""Bumped when a change is not backwards compatible; fields only ever grow, with defaults."""


def check_protocol(remote: int, who: str) -> None:
    if remote != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{who} speaks protocol {remote}, this side speaks {PROTOCOL_VERSION}",
            code=ErrorCode.UNSUPPORTED_PROTOCOL,
        )


__all__ = [
    "PROTOCOL_VERSION",
    "ErrorCode",
    "ProtocolError",
    "WeightwireError",
    "check_protocol",
    "error_from_code",
]
