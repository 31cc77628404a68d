"""A member that floods: a process with a key every daemon allows joins the cluster like a
daemon does (real PeerMesh: hello, heartbeats, its own peer socket for the answers), then
sends `count` messages to one daemon as fast as it can and counts what comes back within
`hold_s`. Prints one JSON line. `kind`: "status" (StatusQuery; StatusAnswers counted) or
"advertise" (to the coordinator: an Advertise of one trainer rank for a job of its own,
`count` jobs; the PlanProblems it is told counted), "hello" / "rejoin" (PeerHello, the
same incarnation or a new one each; welcomes and memberships counted), "flap" (Heartbeat,
a new incarnation and its own in turn).

    python statusflood.py '{"node":"flooder","secret_key":..,"allowed_dir":..,
                            "coordinator":..,"coordinator_key":..,"address":..,
                            "target":"host0","count":20000,"hold_s":5,"kind":"status"}'
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
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
    Advertise,
    Heartbeat,
    Member,
    Membership,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    PlanProblem,
    RankAdvert,
    StatusAnswer,
    StatusQuery,
)
from weightwire.protocol.tensors import SourceTensor


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
    authenticator = start_authenticator(ctx, security)
    mesh = PeerMesh(node, ctx, Codec(PeerMessage, max_bytes=64 << 20), security)
    endpoint = mesh.bind(f"tcp://{spec['address']}:0", str(spec["address"]))
    mesh.know(COORDINATOR, str(spec["coordinator"]), security.coordinator_key)
    members: dict[str, Member] = {}
    mesh.names.members = lambda: members
    target = str(spec["target"])
    joined = asyncio.Event()
    answers = 0
    first = last = 0.0
    problems: dict[str, int] = {}

    async def handle(sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        nonlocal answers, first, last
        match msg:
            case Membership(members=ms):
                answers += joined.is_set()  # kind hello / rejoin: what the hellos cost
                for m in ms:
                    members[m.node] = m
                    if m.node != node:
                        mesh.know(m.node, m.endpoint, m.public_key.encode() or None)
                if target in members and node in members:
                    joined.set()
            case PeerWelcome() if joined.is_set():
                answers += 1
            case StatusAnswer() if sender == target:
                answers += 1
                last = time.monotonic()
                first = first or last
            case PlanProblem(code=code):
                problems[code] = problems.get(code, 0) + 1

    incarnation = secrets.token_hex(8)
    me = Member(node=node, endpoint=endpoint, incarnation=incarnation, public_key=public.decode())

    async def beat() -> None:
        while True:
            mesh.send_soon(COORDINATOR, PeerHello(protocol=PROTOCOL_VERSION, member=me))
            mesh.send_soon(COORDINATOR, Heartbeat(node=node, incarnation=incarnation))
            await asyncio.sleep(0.2)

    out: dict[str, object] = {"event": "statusflood"}
    serving = asyncio.create_task(mesh.serve(handle))
    beating = asyncio.create_task(beat())
    try:
        await asyncio.wait_for(joined.wait(), 20)
        count = int(spec["count"])  # type: ignore[call-overload]
        t0 = time.monotonic()
        sent = 0
        kind = str(spec.get("kind", "status"))
        rank = RankAdvert(
            role="trainer",
            rank=0,
            world_size=1,
            sources=(SourceTensor(name="w", dtype="float32", shape=(1024,)),),
        )
        for i in range(count):
            if kind == "flap":  # a heartbeat as if restarted, then one as it was
                inc = secrets.token_hex(8) if i % 2 == 0 else incarnation
                msg: StatusQuery | Advertise | PeerHello | Heartbeat = Heartbeat(
                    node=node, incarnation=inc
                )
            elif kind in ("hello", "rejoin"):
                inc = secrets.token_hex(8) if kind == "rejoin" else incarnation
                who = Member(
                    node=node, endpoint=endpoint, incarnation=inc, public_key=me.public_key
                )
                msg = PeerHello(protocol=PROTOCOL_VERSION, member=who)
            elif kind == "advertise":
                msg = Advertise(
                    node=node, incarnation=incarnation, job=f"flood-{i}", ranks=(rank,), seq=i + 1
                )
            else:
                msg = StatusQuery(req=i + 1)
            await mesh.send(target, msg)
            sent += 1
            if i % 256 == 0:
                await asyncio.sleep(0)  # answers are read meanwhile
        out["send_s"] = round(time.monotonic() - t0, 3)
        await asyncio.sleep(float(spec.get("hold_s", 5.0)))  # type: ignore[arg-type]
        out.update(
            sent=sent, answers=answers, answer_span_s=round(last - first, 3), problems=problems
        )
    except Exception as exc:
        out["failed"] = repr(exc)
    finally:
        beating.cancel()
        serving.cancel()
        for task in (beating, serving):
            with contextlib.suppress(BaseException):
                await task
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
