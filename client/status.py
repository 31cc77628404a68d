"""A running daemon's status, as `weightwire status` shows it (torch-free)."""

from __future__ import annotations

from typing import Any

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.local import Hello, StatusReply, StatusRequest

from .connection import DaemonConnection, expect


def fetch(socket: str, timeout_s: float = 10.0, *, cluster: bool = False) -> dict[str, Any]:
    """The daemon's status document; `cluster`: every member's, gathered by that daemon."""
    with DaemonConnection(socket, ping_interval_s=3600) as conn:
        conn.request(Hello(protocol=PROTOCOL_VERSION, role="admin", client="weightwire status"))
        reply = expect(conn.request(StatusRequest(cluster=cluster), timeout_s), StatusReply)
        return dict(reply.body)
