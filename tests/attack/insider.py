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

from tests.attack.member import joining, main
from weightwire.protocol.peer import (
    Membership,
    PeerMessage,
    TransportSignal,
)
from weightwire.protocol.regions import RegionDescriptor, RegionKeys, TcpKey
from weightwire.transport.base import LocalRegion, WriteRequest
from weightwire.transport.tcp import TcpTransport


async def run(spec: dict[str, object]) -> dict[str, object]:
    j = joining(spec)
    node, mesh = j.node, j.mesh
    try:
        tcp = TcpTransport(node, bind_host=str(spec["address"]), security=str(spec["security"]))
    except TypeError:  # a transport without security settings (the code before them)
        tcp = TcpTransport(node, bind_host=str(spec["address"]))
    members = j.members
    joined = asyncio.Event()

    async def handle(sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        match msg:
            case Membership(members=ms):
                j.learn(ms)
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
    out: dict[str, object] = {"event": "insider"}
    j.start(handle, j.me(tcp.endpoints()))
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
        await tcp.close()
        await j.stop()
    return out


if __name__ == "__main__":
    main(run)
