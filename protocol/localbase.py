"""What every message on a daemon's local socket shares (`local.py` has the messages):
where the socket is, the base message with its request number, and the bounded numbers.

Requests carry `req`, a number the client picks; the reply to a request carries
the same `req`. Notifications from the daemon (`req` = 0) are unsolicited.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

SOCKET_PATH = "/run/weightwire/weightwired.sock"  # where the daemon listens by default
SOCKET_ENV = "WEIGHTWIRE_SOCKET"  # the variable that points clients (and the cli) elsewhere

Role = Literal["trainer", "engine", "admin"]
Req = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MAX_WORLD = 1 << 16
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]
"""Ranks of one role in a job: far beyond any cluster's, small enough that the coordinator
can list which are missing (a world of 2^40 once held its event loop for hours)."""


class LocalMsg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    req: Req = 0
