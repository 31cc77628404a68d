"""How an SGLang worker reaches its host's weightwired: it waits (bounded, logged) for the
daemon's socket, then opens its Engine client there."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .settings import Settings

log = logging.getLogger("weightwire.adapters.sglang.plugin")  # the plugin's log


def wait_for_daemon(path: str, wait_s: float, *, every_s: float = 10.0) -> None:
    """Until weightwired's socket exists at `path`: an engine started before its host's
    daemon (a pod whose containers start in any order, a unit ordered after SGLang) waits,
    logging when it starts waiting and every `every_s`, instead of failing its start-up.
    After `wait_s`, a WeightwireError says where it looked and what to set."""
    from weightwire.protocol.errors import ErrorCode, WeightwireError

    if os.path.exists(path):
        return
    start = time.monotonic()
    next_log, waited = start, 0.0
    while not os.path.exists(path):
        now = time.monotonic()
        waited = now - start
        if waited >= wait_s:
            raise WeightwireError(
                f"no weightwired socket at {path} after waiting {wait_s:g} s: start weightwired "
                f"on this host, or point WEIGHTWIRE_SOCKET at its local_socket "
                f"(WEIGHTWIRE_DAEMON_WAIT_S sets the wait)",
                code=ErrorCode.PEER_LOST,
            )
        if now >= next_log:
            log.warning(
                "weightwire: waiting for weightwired's socket at %s (%.0f s so far, up to %g s)",
                path,
                waited,
                wait_s,
            )
            next_log = now + every_s
        time.sleep(min(0.1, wait_s - waited))
    log.info("weightwire: weightwired's socket %s appeared after %.1f s", path, waited)


def open_engine(
    settings: Settings,
    rank: int,
    world: int,
    device: int | None,
    *,
    replica: int = -1,
    replica_size: int = 0,
) -> Any:
    """This worker's Engine client, once its daemon is there (`wait_for_daemon`). `replica`,
    `replica_size`: elastic jobs, this server (its TP ranks) comes and goes as one."""
    from weightwire.client import Engine
    from weightwire.client.connection import DEFAULT_SOCKET

    wait_for_daemon(settings.socket or DEFAULT_SOCKET, settings.daemon_wait_s)
    return Engine(
        rank,
        world,
        socket=settings.socket,
        job=settings.job,
        timeout_s=settings.timeout_s,
        device=device,
        replica=replica,
        replica_size=replica_size,
    )
