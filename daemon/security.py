"""Peer authentication: ZeroMQ CURVE keys, an allow-list of peer public keys, and the
explicit (and loud) plaintext escape hatch."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from .config import ConfigError, DaemonConfig
from .peers import Security

log = structlog.get_logger("weightwire.daemon.security")


def missing_key_file(path: str) -> str | None:
    """What to say when a key file does not exist (zmq says only "Invalid certificate
    file"), or None when it does."""
    if Path(path).exists():
        return None
    p = Path(path)
    name = p.name.removesuffix(".key_secret").removesuffix(".key")
    return (
        f"no such file: {path} (run `weightwire keygen --dir {p.parent} --name {name}` on the "
        f"node it belongs to: it writes {name}.key, the public key to share, and "
        f"{name}.key_secret)"
    )


def _public_keys(directory: str) -> set[bytes]:
    """The public keys of the directory's *.key files; ConfigError naming a file that holds
    none (half copied, say) or cannot be read. It escaped as a bare ValueError: a daemon
    started with one died with a traceback, and a SIGHUP logged nothing of ours."""
    keys: set[bytes] = set()
    try:
        paths = sorted(Path(directory).glob("*.key"))
    except OSError as exc:
        raise ConfigError(f"curve_allowed_keys_dir: cannot list {directory}: {exc}") from None
    for path in paths:
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"curve_allowed_keys_dir: cannot load {path}: {exc}") from None
        keys.add(public)
    return keys


def load(cfg: DaemonConfig) -> Security:
    """CURVE keys from the configuration, or plaintext when `insecure` says so."""
    if cfg.insecure:
        log.warning(
            "peer sockets are PLAINTEXT (insecure = true): any host that reaches them can join "
            "and learn region keys; use only on a trusted test network"
        )
        return Security()
    if not cfg.curve_secret_key_file:
        raise ConfigError(
            "peer sockets need CURVE keys: create them with `weightwire keygen` and set "
            "curve_secret_key_file (and curve_allowed_keys_dir), or set insecure = true"
        )
    if missing := missing_key_file(cfg.curve_secret_key_file):
        raise ConfigError(f"curve_secret_key_file: {missing}")
    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE key {cfg.curve_secret_key_file}: {exc}") from None
    if secret is None:
        raise ConfigError(f"{cfg.curve_secret_key_file} holds no secret key")
    allowed = {k.encode() for k in cfg.curve_allowed_keys}
    if cfg.curve_allowed_keys_dir:
        if not Path(cfg.curve_allowed_keys_dir).is_dir():  # else no peer would ever be trusted
            raise ConfigError(
                f"curve_allowed_keys_dir: no such directory: {cfg.curve_allowed_keys_dir} "
                "(create it and copy each peer's public <name>.key into it)"
            )
        allowed |= _public_keys(cfg.curve_allowed_keys_dir)
    allowed.add(public)
    coordinator = None
    if cfg.coordinator_public_key:
        coordinator = cfg.coordinator_public_key.encode()
    elif cfg.is_coordinator:
        coordinator = public
    else:
        raise ConfigError("CURVE is on: set coordinator_public_key (the coordinator's public key)")
    return Security(
        public_key=public,
        secret_key=secret,
        allowed=frozenset(allowed),
        coordinator_key=coordinator,
    )


class AllowList:
    """The ZAP credentials provider: known keys pass; unknown ones are refused and logged."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self._last_logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        now = time.monotonic()
        if now - self._last_logged.get(key, 0.0) > 10.0:  # one line per key per 10 s
            self._last_logged[key] = now
            log.warning("peer refused: unknown CURVE key", key=key.decode(errors="replace"))
        return False


class KeyAuthenticator(AsyncioAuthenticator):
    """ZAP handler whose user id is the peer's z85 public key: every message a peer sends
    carries it (`User-Id` metadata), and names.py binds node names to it."""

    def curve_user_id(self, client_public_key: bytes) -> str:
        return z85.encode(client_public_key).decode("ascii")


def start_authenticator(ctx: zmq.asyncio.Context, security: Security) -> KeyAuthenticator | None:
    if not security.curve:
        return None
    auth = KeyAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AllowList(security.allowed))
    return auth


def keygen(directory: str, name: str) -> tuple[Path, Path]:
    """`weightwire keygen`: NAME.key (public, share it) and NAME.key_secret (keep it)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(out), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)
