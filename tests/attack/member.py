"""What the attack tools share: a process holding a key every daemon allows that joins the
cluster as a daemon does (real PeerMesh with its own peer socket, CURVE, the membership's
bindings, hellos and heartbeats to the coordinator)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth

from weightwire.daemon.peers import COORDINATOR, PeerMesh, Security
from weightwire.daemon.security import start_authenticator
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.frames import Codec
from weightwire.protocol.peer import Heartbeat, Member, PeerHello, PeerMessage
from weightwire.protocol.regions import TransportEndpoints


@dataclass
class Joining:
    node: str
    mesh: PeerMesh
    ctx: zmq.asyncio.Context
    authenticator: Any
    endpoint: str
    public_key: str
    members: dict[str, Member] = field(default_factory=dict)
    incarnation: str = field(default_factory=lambda: secrets.token_hex(8))
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def me(self, transports: TransportEndpoints | None = None) -> Member:
        return Member(
            node=self.node,
            endpoint=self.endpoint,
            incarnation=self.incarnation,
            transports=transports or TransportEndpoints(),
            public_key=self.public_key,
        )

    def learn(self, members: tuple[Member, ...]) -> None:
        """A membership: its bindings, and where each member listens."""
        for m in members:
            self.members[m.node] = m
            if m.node != self.node:
                self.mesh.know(m.node, m.endpoint, m.public_key.encode() or None)

    def start(
        self,
        handle: Callable[[str, PeerMessage, bytes | None], Awaitable[None]],
        me: Member,
    ) -> None:
        async def beat() -> None:
            while True:
                self.mesh.send_soon(COORDINATOR, PeerHello(protocol=PROTOCOL_VERSION, member=me))
                self.mesh.send_soon(
                    COORDINATOR, Heartbeat(node=self.node, incarnation=self.incarnation)
                )
                await asyncio.sleep(0.2)

        self._tasks = [
            asyncio.create_task(self.mesh.serve(handle)),
            asyncio.create_task(beat()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self.mesh.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()


def joining(spec: dict[str, object], max_bytes: int = 64 << 20) -> Joining:
    """The mesh of member `spec["node"]` (keys from `spec`), bound and knowing the
    coordinator; `start` it with a handler."""
    node = str(spec["node"])
    public, secret = zmq.auth.load_certificate(str(spec["secret_key"]))
    allowed = {public}
    for path in sorted(Path(str(spec["allowed_dir"])).glob("*.key")):
        allowed.add(zmq.auth.load_certificate(str(path))[0])
    security = Security(
        public_key=public,
        secret_key=secret,
        allowed=frozenset(allowed),
        coordinator_key=str(spec["coordinator_key"]).encode(),
    )
    ctx = zmq.asyncio.Context()
    authenticator = start_authenticator(ctx, security)  # as a daemon: peers' keys on messages
    mesh = PeerMesh(node, ctx, Codec(PeerMessage, max_bytes=max_bytes), security)
    endpoint = mesh.bind(f"tcp://{spec['address']}:0", str(spec["address"]))
    mesh.know(COORDINATOR, str(spec["coordinator"]), security.coordinator_key)
    j = Joining(node, mesh, ctx, authenticator, endpoint, public.decode())
    mesh.names.members = lambda: j.members  # bindings from the membership, as a daemon does
    return j


def main(run: Callable[[dict[str, object]], Awaitable[dict[str, object]]]) -> None:
    """A tool's entry: its spec (JSON) from argv, its outcome as one JSON line."""
    import json
    import sys

    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1]))), default=str), flush=True)
