"""The SGLang plugin's settings: the environment of the SGLang server (its workers inherit
it), read once per hook; the table is in `plugin`'s docstring."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MODES = ("rules", "replica")


@dataclass(frozen=True)
class Settings:
    mode: str = "off"
    socket: str | None = None
    job: str = "default"
    replica: int = 0
    replicas: int = 1
    dest_dtype: str = ""
    timeout_s: float = 300.0
    daemon_wait_s: float = 300.0  # the engine may start before its host's weightwired

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        mode = env.get("WEIGHTWIRE_SGLANG", "off").strip().lower() or "off"
        if mode not in (*MODES, "off"):
            raise ValueError(f"WEIGHTWIRE_SGLANG={mode!r}: expected rules, replica or off")

        def integer(name: str, default: int, low: int) -> int:
            raw = env.get(name, "")
            try:
                value = int(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
            if value < low:
                raise ValueError(f"{name}={value} must be at least {low}")
            return value

        s = cls(
            mode=mode,
            socket=env.get("WEIGHTWIRE_SOCKET") or None,
            job=env.get("WEIGHTWIRE_JOB") or "default",
            replica=integer("WEIGHTWIRE_ENGINE_REPLICA", 0, 0),
            replicas=integer("WEIGHTWIRE_ENGINE_REPLICAS", 1, 1),
            dest_dtype=env.get("WEIGHTWIRE_DEST_DTYPE", ""),
            timeout_s=float(env.get("WEIGHTWIRE_TIMEOUT_S") or 300.0),
            daemon_wait_s=float(env.get("WEIGHTWIRE_DAEMON_WAIT_S") or 300.0),
        )
        return s
