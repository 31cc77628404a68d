"""The local socket itself: bound on its ipc path (a stale one removed, a live one never
stolen), and asked whether a rank's connection is still there."""

from __future__ import annotations

import contextlib
import os
import socket
import stat

import zmq
import zmq.asyncio

from weightwire.protocol.errors import ErrorCode, WeightwireError

from . import fdguard


def bind(ctx: zmq.asyncio.Context, path: str, mode: int, max_msg_bytes: int) -> zmq.asyncio.Socket:
    """A ROUTER bound on ipc `path`, which gets permissions `mode` (no wider meanwhile)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.setsockopt(zmq.BACKLOG, fdguard.BACKLOG)
    _remove_stale_socket(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + ".full")  # a paused name left by a daemon that died
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return sock


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse to steal a live one."""
    try:
        st_mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st_mode):
        raise WeightwireError(f"{path} exists and is not a socket", code=ErrorCode.INVALID)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise WeightwireError(f"another daemon is serving {path}", code=ErrorCode.DUPLICATE)


def gone(sock: zmq.asyncio.Socket, identity: bytes) -> bool:
    """Whether the connection of `identity` is closed (its process ended): ZeroMQ knows
    at once, and says so to a send that must be routed (an empty frame, which a rank
    that is still there ignores as undecodable)."""
    now: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # raises, no future
    now.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        now.send_multipart([identity, b""], flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        return exc.errno == zmq.EHOSTUNREACH
    finally:
        now.setsockopt(zmq.ROUTER_MANDATORY, 0)
    return False
