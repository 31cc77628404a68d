"""Which data planes this daemon runs, from its configuration."""

from __future__ import annotations

import os

import structlog

from weightwire.transport.base import Transport
from weightwire.transport.tcp import TcpTransport

from .config import ConfigError, DaemonConfig

log = structlog.get_logger("weightwire.daemon")


def make_transports(cfg: DaemonConfig) -> list[Transport]:
    """Transports in order of preference; tcp is always last, reaching every node."""
    chosen: list[Transport] = []
    if cfg.cuda != "off":
        from weightwire.transport.cudadrv import available

        ok, why = available()
        if ok:
            from weightwire.transport.cuda import CudaTransport

            chosen.append(CudaTransport(cfg.node, channel_dir=os.path.dirname(cfg.local_socket)))
        elif cfg.cuda == "on":
            raise ConfigError(f'cuda = "on" but {why}')
        else:
            log.info("no cuda transport", reason=why)
    tcp = TcpTransport(
        cfg.node,
        bind_host=cfg.tcp_bind,
        port=cfg.tcp_port,
        advertise_host=cfg.advertise_host,
        streams=cfg.tcp_streams,
        stall_timeout_s=cfg.stall_timeout_s,
    )
    chosen.append(tcp)
    return chosen
