"""Daemon configuration: a TOML file, with command-line flags overriding it."""

from __future__ import annotations

import argparse
import socket
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from weightwire.protocol.errors import ErrorCode, WeightwireError
from weightwire.protocol.local import SOCKET_PATH

DEFAULT_CONFIG = "/etc/weightwire/weightwired.toml"
DEFAULT_SOCKET = SOCKET_PATH


class ConfigError(WeightwireError):
    code = ErrorCode.INVALID


class DaemonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of weightwired. See systemd/weightwired.toml for a commented example."""

    node: str = ""  # this daemon's name in the cluster; default: the host name
    local_socket: str = DEFAULT_SOCKET  # ipc path where the ranks of this host connect
    socket_mode: int = 0o660
    region_dir: str = "/dev/shm"  # where ranks make the shared files of their host memory
    peer_bind: str = "tcp://0.0.0.0:7470"  # daemon-to-daemon socket
    advertise_host: str = ""  # the address peers use to reach this host; default: the host name's
    coordinator: str = ""  # peer endpoint of the coordinator, e.g. tcp://10.0.0.1:7470
    is_coordinator: bool = False
    curve_secret_key_file: str = ""  # this node's key pair (weightwire keygen): NAME.key_secret
    curve_allowed_keys_dir: str = ""  # public keys (*.key) of the peers this node trusts
    curve_allowed_keys: list[str] = []  # more trusted public keys, z85
    coordinator_public_key: str = ""  # z85; required on non-coordinators when CURVE is on
    insecure: bool = False  # plaintext peer sockets (logs a warning); never in production
    transport: Literal["tcp", "verbs", "auto"] = "auto"  # auto: verbs if an RDMA port is active
    verbs_devices: list[str] = []  # RDMA devices (`mlx5_0`, `mlx5_1:2` for port 2); []: all active
    verbs_gid_index: int = -1  # -1: a RoCE v2 GID, IPv4-mapped preferred
    verbs_chunk_bytes: int = 8 << 20  # bytes per work request (capped by the port's max_msg_sz)
    verbs_wr_per_post: int = 4  # WRs chained per post (TransferEngine: more than ~4 gains nothing)
    verbs_qps_per_peer: int = 1  # RC queue pairs per (local NIC, remote NIC)
    verbs_send_depth: int = 512  # send queue depth per queue pair (capped by the device)
    verbs_recv_depth: int = 128  # receives kept posted per incoming queue pair (immediates)
    verbs_nics_per_gpu: int = 0  # NICs a GPU's memory uses, nearest by PCIe/NUMA first; 0: all
    verbs_host_nics: int = 1  # NICs host (CPU) memory uses; 0: all
    verbs_relaxed_ordering: bool = True  # register memory with relaxed ordering where supported
    verbs_completions: Literal["auto", "channel", "thread"] = "auto"  # how completions are waited
    cuda: Literal["auto", "on", "off"] = "auto"  # same-host GPU writes (auto: if a GPU is visible)
    tcp_bind: str = "0.0.0.0"
    tcp_port: int = 0
    tcp_streams: int = 4
    tcp_handshake_timeout_s: float = 10.0  # a data connection not authenticated in time is closed
    tcp_max_unauthenticated: int = 64  # connections not yet authenticated; more are refused
    tcp_max_streams_per_peer: int = 64  # data connections one node may hold open here
    # tcp data connections: "auth" (peer authenticated, every frame MACed), "encrypt" (and
    # encrypted: untrusted networks), "off" (plain: anyone who reaches the port and knows an
    # rkey can write); the stronger of two nodes' settings wins
    tcp_security: Literal["auth", "encrypt", "off"] = "auth"
    stall_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.5
    session_timeout_s: float = 5.0  # a rank silent this long (clients ping every second) is gone
    version_timeout_s: float = 600.0
    shutdown_timeout_s: float = 10.0
    bucket_bytes: int = 256 << 20
    max_write_bytes: int = 32 << 20
    max_message_bytes: int = 64 << 20
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    ready_file: str = ""  # where to write the real endpoints (JSON) once serving
    metrics_bind: str = ""  # HOST:PORT of the Prometheus endpoint (the [metrics] extra); "": off

    def resolved(self) -> DaemonConfig:
        node = self.node or socket.gethostname()
        advertise = self.advertise_host or _host_of(self.peer_bind) or socket.gethostname()
        if advertise in ("0.0.0.0", "*", "::"):
            advertise = socket.gethostbyname(socket.gethostname())
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
        return msgspec.structs.replace(self, node=node, advertise_host=advertise)


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


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, named like the setting (`--tcp-streams` for tcp_streams)."""
    for name, ftype in DaemonConfig.__annotations__.items():
        flag = "--" + name.replace("_", "-")
        if ftype.startswith("list"):
            parser.add_argument(flag, dest=name, action="append")
        elif ftype == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction)
        elif ftype == "int":
            parser.add_argument(flag, dest=name, type=lambda v: int(v, 0))
        elif ftype == "float":
            parser.add_argument(flag, dest=name, type=float)
        else:
            parser.add_argument(flag, dest=name)
