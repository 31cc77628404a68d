"""Daemon configuration: a TOML file, with command-line flags overriding it."""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import SOCKET_PATH

DEFAULT_CONFIG = "/etc/weightwire/weightwired.toml"
DEFAULT_SOCKET = SOCKET_PATH
MiB = 1 << 20


class ConfigError(WeightwireError):
    code = ErrorCode.INVALID


class DaemonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of weightwired. See systemd/weightwired.toml for a commented example."""

    node: str = ""  # this daemon's name in the cluster (default: the host name)
    # the ipc socket where the ranks of this host connect (WEIGHTWIRE_SOCKET in ranks)
    local_socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660  # the local socket's permissions (group weightwire under systemd)
    # where ranks make the shared files of their host memory: a tmpfs, every page reserved
    # when a file is made (a full one is a no_space error, not SIGBUS); ranks learn it from
    # the daemon. In containers: the same path in every pod (see "Containers")
    region_dir: str = "/dev/shm"
    # daemon-to-daemon socket (ZeroMQ, CURVE-authenticated); port 0: any, the real one is
    # logged and written to ready_file
    peer_bind: str = "tcp://0.0.0.0:7470"
    # the address peers use to reach this host (default: peer_bind's host). Set it when
    # peer_bind is a wildcard (0.0.0.0): the host name's address is used then, and a loopback
    # one (127.0.1.1 on Debian) or a name that does not resolve refuses to start
    advertise_host: str = ""
    # the coordinator's peer endpoint, e.g. tcp://10.0.0.1:7470 (not on the coordinator)
    coordinator: str = ""
    # this daemon is the coordinator (exactly one per cluster: it computes the plans)
    is_coordinator: bool = False
    # this node's key pair, NAME.key_secret from `weightwire keygen --dir /etc/weightwire
    # --name NAME` (NAME: the host name, as in the README's steps)
    curve_secret_key_file: str = ""
    # a directory of the public keys (*.key) of the peers this node trusts; it must exist
    # (the daemon will not start without it); SIGHUP rereads it
    curve_allowed_keys_dir: str = ""
    curve_allowed_keys: list[str] = []  # more trusted public keys, z85
    # the coordinator's public key, z85 (`weightwire pubkey A.key`); required on the other
    # nodes when CURVE is on. Only this key may hand out plans and membership; the
    # coordinator binds every other node's name to the key of its first hello
    coordinator_public_key: str = ""
    # plaintext peer sockets (logs a warning): only on a trusted test network, never in
    # production
    insecure: bool = False
    # data plane: "verbs" (RDMA), "tcp", or "auto" (verbs when an active RDMA port exists,
    # else tcp, and the log says why); "verbs" with no active port refuses to start. tcp
    # always runs too: it reaches nodes without RDMA and memory verbs could not register
    transport: Literal["tcp", "verbs", "auto"] = "auto"
    # RDMA devices to use, `mlx5_0` or `mlx5_1:2` (port 2); []: every device with an
    # ACTIVE port
    verbs_devices: list[str] = []
    # GID index; -1 picks a RoCE v2 GID, IPv4-mapped preferred (InfiniBand: 0)
    verbs_gid_index: int = -1
    # bytes per work request, capped by the port's max_msg_sz (one WR is one message; the
    # NIC segments it by MTU, so larger WRs only cost less CPU per byte)
    verbs_chunk_bytes: int = 8 << 20
    # WRs chained per post_send (Perplexity's TransferEngine: no gain beyond ~4)
    verbs_wr_per_post: int = 4
    # RC queue pairs per (local NIC, remote NIC); TransferEngine uses one per peer and NIC
    verbs_qps_per_peer: int = 1
    verbs_send_depth: int = 512  # send queue depth per queue pair (capped by max_qp_wr)
    # receives posted per incoming queue pair (TransferEngine keeps 128); also caps the
    # WRITE_WITH_IMMs in flight per queue pair
    verbs_recv_depth: int = 128
    # NICs a GPU's memory is registered on and striped over, nearest first by PCIe switch,
    # then NUMA node; 0: all of the nearest (as TransferEngine)
    verbs_nics_per_gpu: int = 0
    verbs_host_nics: int = 1  # NICs for host memory (CPU staging, CPU replicas); 0: all
    # register memory with IBV_ACCESS_RELAXED_ORDERING where the NIC supports it
    # (TransferEngine: needed for full rate)
    verbs_relaxed_ordering: bool = True
    # how completions are waited for: "channel" (the event fd on the loop), "thread" (a
    # polling thread), or "auto"
    verbs_completions: Literal["auto", "channel", "thread"] = "auto"
    # same-host GPU-to-GPU writes over CUDA IPC: "auto" (when a GPU is visible), "on", "off"
    cuda: Literal["auto", "on", "off"] = "auto"
    tcp_bind: str = "0.0.0.0"  # tcp data plane: listen address
    tcp_port: int = 0  # tcp data plane: port (0: any; advertised to peers)
    # tcp data plane: parallel connections per peer (0: 4, or the host's cores if fewer:
    # each stream's copies and tags take a core; on 2 cores 4 streams moved no more dense
    # bytes than 2 and made a delta version 4-7 % slower)
    tcp_streams: int = 0
    # a data connection not authenticated (hello and ticket proof) this long after it was
    # accepted is closed
    tcp_handshake_timeout_s: float = 10.0
    # data connections accepted but not yet authenticated; past it each new one closes the
    # oldest such (a flood costs at most this many threads, and cannot shut writers out)
    tcp_max_unauthenticated: int = 64
    # data connections one node (by its authenticated name) may hold open here; more are
    # refused once it is authenticated
    tcp_max_streams_per_peer: int = 64
    # tcp data connections: "auth" (peer authenticated by its CURVE identity, every header,
    # immediate and payload byte MACed), "encrypt" (the same, and encrypted: for untrusted
    # networks), "off" (plain: anyone who reaches the port and knows an rkey can write;
    # warns at start). Between two nodes the stronger setting wins. See "Trust model"
    tcp_security: Literal["auth", "encrypt", "off"] = "auth"
    # pinned host memory each tcp stream may hold to move a GPU region's bytes (either end;
    # a whole number of MiB, at least 1): larger writes go through it in pieces, so a
    # peer's one large write cannot make this host pin (unswappable) memory of its size
    tcp_bounce_bytes: int = 64 << 20
    # a data connection making no progress this long is failed (on tcp: a frame not whole
    # this long after its first byte)
    stall_timeout_s: float = 30.0
    # liveness between daemons: a heartbeat this often; also the ZeroMQ (ZMTP) heartbeat of
    # every peer connection
    heartbeat_interval_s: float = 0.5
    # a peer silent this long is lost (its versions fail with peer_lost); more than twice
    # heartbeat_interval_s. A peer connection silent this long is closed and reconnected
    # (every 0.1 s, backing off to 0.5 s), so a node is back within about a second of its
    # link returning
    heartbeat_timeout_s: float = 2.5
    # a rank silent this long (clients ping every second) is released, with what it holds;
    # at once if its process ended and the same rank connects again (a restart)
    session_timeout_s: float = 5.0
    version_timeout_s: float = 600.0  # a version still incomplete after this long fails
    shutdown_timeout_s: float = 10.0  # SIGTERM: the longest the transports get to close
    bucket_bytes: int = 256 << 20  # plan granularity (the coordinator's): bytes per bucket
    # the last bucket_bytes of each trainer rank's send go in buckets of at most this, so
    # less is left to cross and to apply after its last bucket is packed (0: off)
    bucket_tail_bytes: int = 64 << 20
    max_write_bytes: int = 32 << 20  # plan granularity: the largest single write
    # control messages larger than this are refused (too_large); beyond 16 times it, dropped
    max_message_bytes: int = 64 << 20
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # JSON lines on stdout
    # where to write the real endpoints (JSON) once serving (for scripts and tests)
    ready_file: str = ""
    # HOST:PORT of the Prometheus endpoint (needs the [metrics] extra; port 0: any); "": off
    metrics_bind: str = ""

    def resolved(self) -> DaemonConfig:
        node = self.node or socket.gethostname()
        advertise = self.advertise_host or _host_of(self.peer_bind) or socket.gethostname()
        if advertise in _WILDCARDS:
            advertise = _host_address(self.peer_bind)
        coordinator = self.coordinator
        if not coordinator and not self.is_coordinator:
            raise ConfigError(
                'no coordinator: set `coordinator = "tcp://HOST:PORT"` or `is_coordinator = true`'
            )
        if not self.region_dir.startswith("/") or "\0" in self.region_dir:
            raise ConfigError(f"region_dir {self.region_dir!r} must be an absolute path")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.tcp_streams < 0:
            raise ConfigError(f"tcp_streams {self.tcp_streams} must be 0 (by the cores) or more")
        if self.tcp_bounce_bytes < MiB or self.tcp_bounce_bytes % MiB:
            raise ConfigError(
                f"tcp_bounce_bytes {self.tcp_bounce_bytes} must be a whole number of MiB "
                f"({MiB} bytes), at least one (payloads move in 1 MiB records)"
            )
        streams = self.tcp_streams or default_tcp_streams()
        return msgspec.structs.replace(
            self, node=node, advertise_host=advertise, tcp_streams=streams
        )


_WILDCARDS = ("0.0.0.0", "*", "::")


def default_tcp_streams() -> int:
    """tcp_streams = 0: 4, or the cores this process may run on if fewer."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _host_address(peer_bind: str) -> str:
    """This host's address by its name, for a wildcard peer_bind: never loopback."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"peer_bind {peer_bind} listens on every address, and this host's name {name!r} "
            f"does not resolve ({exc}): set advertise_host to the address peers reach this "
            f"host at"
        ) from None
    if ipaddress.ip_address(address).is_loopback:
        raise ConfigError(
            f"peer_bind {peer_bind} listens on every address, and this host's name {name!r} "
            f"resolves to {address}, a loopback address other hosts cannot reach (Debian's "
            f"/etc/hosts maps the host name to 127.0.1.1): set advertise_host to the address "
            f'peers reach this host at (advertise_host = "127.0.0.1" if every node runs on '
            f"this host)"
        )
    return address


def _host_of(endpoint: str) -> str:
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


def load(path: str | None, overrides: dict[str, object]) -> DaemonConfig:
    """The configuration from `path` (if given, or the default file if it exists) and flags."""
    data: dict[str, object] = {}
    file = Path(path) if path else Path(DEFAULT_CONFIG)
    if path or file.exists():
        try:
            data = tomllib.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(data, DaemonConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad configuration ({file if path else 'flags'}): {exc}") from None
