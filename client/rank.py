"""What every rank client shares: its session with the local daemon.

The hello, the connection (pings, notifications), re-registration after a daemon
restart (`_replay`, per role) and failing in-flight calls when the daemon is lost.
"""

from __future__ import annotations

import os
from typing import Literal, Self

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PeerLostError, WeightwireError
from weightwire.protocol.local import Hello, LocalMessage

from .connection import DaemonConnection
from .cuda import gpu_uuid
from .inputs import index_of, timeout_of


class RankClient:
    def __init__(
        self,
        role: Literal["trainer", "engine"],
        rank: int,
        world_size: int,
        *,
        socket: str | None,
        job: str,
        timeout_s: float,
        device: int | None,
        replica: int = -1,
        replica_size: int = 0,
    ) -> None:
        rank, world_size = index_of(rank, "rank"), index_of(world_size, "world_size")
        timeout_s = timeout_of(timeout_s, timeout_s)
        self.rank, self.world_size, self.job, self.timeout_s = rank, world_size, job, timeout_s
        self._hello = Hello(
            protocol=PROTOCOL_VERSION,
            role=role,
            rank=rank,
            world_size=world_size,
            job=job,
            pid=os.getpid(),
            client=f"weightwire.client.{type(self).__name__}",
            device_uuid=gpu_uuid(device),
            replica=replica,
            replica_size=replica_size,
        )
        self._conn = DaemonConnection(
            socket,
            on_notify=self._on_notify,
            on_reset=self._replay,
            on_lost=self._lost,
            inline=self._on_notify_inline,
        )
        self._conn.request(self._hello)

    def _on_notify(self, msg: LocalMessage) -> None:
        """A notification from the daemon (version landed, publish result)."""

    def _on_notify_inline(self, msg: LocalMessage) -> bool:
        """A notification taken on the connection's thread as it is read (True), one thread
        hop sooner than `_on_notify`: only what is quick and never blocks."""
        return False

    def _replay(self) -> None:
        """The daemon restarted and forgot this rank: register everything again."""
        self._conn.request(self._hello)

    def _lost(self) -> None:
        self._fail_pending(
            PeerLostError(
                f"the daemon at {self._conn.path} has not answered for "
                f"{self._conn.lost_after_s:.0f} s"
            )
        )

    def _fail_pending(self, exc: Exception) -> None:
        self._conn.fail_pending(exc)

    def close(self) -> None:
        """Calls of other threads still waiting on the daemon (a publish, a wait) fail at
        once, typed; they used to wait out their whole timeout. Then the session ends."""
        role = self._hello.role
        self._fail_pending(
            WeightwireError(f"{role} rank {self.rank} was closed", code=ErrorCode.PEER_LOST)
        )
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
