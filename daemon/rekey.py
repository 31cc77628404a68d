"""SIGHUP: read the trusted keys again (curve_allowed_keys_dir, curve_allowed_keys,
coordinator_public_key) without a restart.

A node added to the cluster needs only its public key dropped into every peer's
allow-list directory and a SIGHUP. The ZAP handler checks keys at each handshake, so a
newly trusted key is let in at its next attempt (joining nodes retry every second). A key
removed from the list is refused from its next handshake on, and the mesh drops what it
sends on connections it already has (peers.py), so its node is soon lost. This node's own
key pair is not swapped on a running daemon (its sockets were made with it): a changed
pair on disk is reported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from weightwire.protocol.errors import WeightwireError

from .config import DaemonConfig
from .membership import Membership
from .peers import COORDINATOR, PeerMesh
from .security import AllowList
from .security import load as load_security

log = structlog.get_logger("weightwire.daemon")


def reload_keys(cfg: DaemonConfig, mesh: PeerMesh, authenticator: Any, view: Membership) -> None:
    old = mesh.security
    if not old.curve:
        log.info("SIGHUP: peer sockets are plaintext (insecure = true); no keys to reload")
        return
    try:
        new = load_security(cfg)
    except WeightwireError as exc:
        log.error("SIGHUP: keys not reloaded; the old ones stay in use", error=exc.message)
        return
    if new.public_key != old.public_key:
        log.warning(
            "SIGHUP: this node's key pair changed on disk; it takes effect at the next restart",
            key_file=cfg.curve_secret_key_file,
        )
    if authenticator is not None:
        authenticator.configure_curve_callback(
            domain="*", credentials_provider=AllowList(new.allowed)
        )
    mesh.security = dataclasses.replace(
        old, allowed=new.allowed, coordinator_key=new.coordinator_key
    )
    if new.coordinator_key != old.coordinator_key and view.coordinator is None:
        mesh.know(COORDINATOR, cfg.coordinator, new.coordinator_key)
        view.coordinator_name = None  # join again, through a socket that expects the new key
    log.info(
        "keys reloaded",
        trusted=len(new.allowed),
        added=len(new.allowed - old.allowed),
        removed=len(old.allowed - new.allowed),
        coordinator_key_changed=new.coordinator_key != old.coordinator_key,
    )
