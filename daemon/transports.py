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
        from weightwire.memory.cudadrv import available

        ok, why = available()
        if ok:
            from weightwire.transport.cuda import CudaTransport

            chosen.append(CudaTransport(cfg.node, channel_dir=os.path.dirname(cfg.local_socket)))
        elif cfg.cuda == "on":
            raise ConfigError(f'cuda = "on" but {why}')
        else:
            log.info("no cuda transport", reason=why)
    verbs = _verbs(cfg)
    if verbs is not None:
        chosen.append(verbs)
    tcp = TcpTransport(
        cfg.node,
        bind_host=cfg.tcp_bind,
        port=cfg.tcp_port,
        advertise_host=cfg.advertise_host,
        streams=cfg.tcp_streams,
        stall_timeout_s=cfg.stall_timeout_s,
        handshake_timeout_s=cfg.tcp_handshake_timeout_s,
        max_unauthenticated=cfg.tcp_max_unauthenticated,
        max_streams_per_peer=cfg.tcp_max_streams_per_peer,
        security=cfg.tcp_security,
        bounce_bytes=cfg.tcp_bounce_bytes,
    )
    if cfg.tcp_security == "off":
        log.warning(
            "tcp data connections are UNAUTHENTICATED (tcp_security = off): any host that "
            "reaches the data port and learns an rkey can write into registered memory"
        )
    chosen.append(tcp)
    return chosen


def _verbs(cfg: DaemonConfig) -> Transport | None:
    """The verbs transport per `transport`: "verbs" needs it (a startup error naming the
    alternative otherwise), "auto" uses it when an active RDMA device exists and says why
    not in one log line, "tcp" never starts it."""
    if cfg.transport == "tcp":
        return None
    from weightwire.transport.verbs import VerbsTransport, VerbsUnavailable

    devices = [d for spec in cfg.verbs_devices for d in spec.split(",") if d.strip()]
    try:
        return VerbsTransport(
            cfg.node,
            devices=devices,
            gid_index=cfg.verbs_gid_index,
            chunk_bytes=cfg.verbs_chunk_bytes,
            wr_per_post=cfg.verbs_wr_per_post,
            qps_per_peer=cfg.verbs_qps_per_peer,
            send_depth=cfg.verbs_send_depth,
            recv_depth=cfg.verbs_recv_depth,
            nics_per_gpu=cfg.verbs_nics_per_gpu,
            host_nics=cfg.verbs_host_nics,
            relaxed_ordering=cfg.verbs_relaxed_ordering,
            completions=cfg.verbs_completions,
            stall_timeout_s=cfg.stall_timeout_s,
        )
    except VerbsUnavailable as exc:
        if cfg.transport == "verbs":
            raise ConfigError(f'transport = "verbs" but {exc.message}') from None
        log.info("no RDMA: weights move over tcp", reason=exc.message)
        return None
