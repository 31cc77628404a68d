"""An insider: a node with a valid CURVE key that joins the cluster like a daemon does
(real PeerMesh, real TcpTransport, tickets through the control channel), but that no
plan names as a source. It writes 0xFF into a region it is not a source of, with the key
and immediate captured on the wire, and prints the outcome as one JSON line.

    python insider.py '{"node":"mallory","secret_key":..,"allowed_dir":..,"coordinator":..,
                        "coordinator_key":..,
                        "address":..,"target":"host1","region":..,"rkey":..,"offset":..,
                        "imm":..,"length":65536,"security":"auth"}'
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
import zmq.auth

from weightwire.daemon.peers import COORDINATOR, PeerMesh, Security
from weightwire.daemon.security import start_authenticator
from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.frames import Codec
from weightwire.protocol.peer import (
    Heartbeat,
    Member,
    Membership,
    PeerHello,
    PeerMessage,
    TransportSignal,
)
from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.tcp import TcpTransport


async def run(spec: dict[str, object]) -> dict[str, object]:
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
    mesh = PeerMesh(node, ctx, Codec(PeerMessage), security)
    endpoint = mesh.bind(f"tcp://{spec['address']}:0", str(spec["address"]))
    mesh.know(COORDINATOR, str(spec["coordinator"]), security.coordinator_key)
    try:
        tcp = TcpTransport(node, bind_host=str(spec["address"]), security=str(spec["security"]))
    except TypeError:  # a transport without security settings (the code before them)
        tcp = TcpTransport(node, bind_host=str(spec["address"]))
    members: dict[str, Member] = {}
    mesh.names.members = lambda: members  # bindings from the membership, as a daemon does
    joined = asyncio.Event()

    async def handle(sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        match msg:
            case Membership(members=ms):
                for m in ms:
                    members[m.node] = m
                    if m.node != node:
                        mesh.know(m.node, m.endpoint, m.public_key.encode() or None)
                if str(spec["target"]) in members and node in members:
                    joined.set()
            case TransportSignal(reply=True):
                mesh.resolve(sender, msg.req, msg)

    async def signal(peer: str, payload: bytes) -> bytes:
        msg = TransportSignal(transport="tcp", node=node, payload=payload)
        reply = await mesh.request(peer, msg, 10.0)
        assert isinstance(reply, TransportSignal)
        return reply.payload

    await tcp.start(lambda imm, src: None)
    tcp.set_signal(signal)
    incarnation = secrets.token_hex(8)
    me = Member(
        node=node,
        endpoint=endpoint,
        incarnation=incarnation,
        transports=tcp.endpoints(),
        public_key=public.decode(),
    )

    async def beat() -> None:
        while True:
            mesh.send_soon(COORDINATOR, PeerHello(protocol=PROTOCOL_VERSION, member=me))
            mesh.send_soon(COORDINATOR, Heartbeat(node=node, incarnation=incarnation))
            await asyncio.sleep(0.2)

    out: dict[str, object] = {"event": "insider"}
    serving = asyncio.create_task(mesh.serve(handle))
    beating = asyncio.create_task(beat())
    try:
        await asyncio.wait_for(joined.wait(), 20)
        out["joined"] = True
        target = str(spec["target"])
        length = int(spec.get("length", 65536))  # type: ignore[call-overload]
        src = LocalRegion(
            id=1, kind="cpu", length=length, view=memoryview(bytearray(b"\xff" * length))
        )
        dst = RegionDescriptor(
            id=int(spec["region"]),  # type: ignore[call-overload]
            node=target,
            kind="cpu",
            length=int(spec["offset"]) + length,  # type: ignore[call-overload]
            keys=RegionKeys(tcp=TcpKey(rkey=int(spec["rkey"]))),  # type: ignore[call-overload]
        )
        await asyncio.wait_for(tcp.connect(target, members[target].transports), 20)
        out["connected"] = True
        try:
            await asyncio.wait_for(
                tcp.write(WriteRequest(src, 0, dst, int(spec["offset"]), length, int(spec["imm"]))),
                20,  # type: ignore[call-overload]
            )
            out["written"] = True
        except Exception as exc:
            out["written"] = False
            out["error"] = {
                "type": type(exc).__name__,
                "code": getattr(exc, "code", ""),
                "message": str(exc),
            }
    except Exception as exc:
        out["failed"] = repr(exc)
    finally:
        beating.cancel()
        serving.cancel()
        for task in (beating, serving):
            with contextlib.suppress(BaseException):
                await task
        await tcp.close()
        mesh.close()
        if authenticator is not None:
            authenticator.stop()
        ctx.term()
    return out


def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1]))), default=str), flush=True)


if __name__ == "__main__":
    main()
