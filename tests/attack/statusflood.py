"""A member that floods: a process with a key every daemon allows joins the cluster like a
daemon does (real PeerMesh: hello, heartbeats, its own peer socket for the answers), then
sends `count` messages to one daemon as fast as it can and counts what comes back within
`hold_s`. Prints one JSON line. `kind`: "status" (StatusQuery; StatusAnswers counted) or
"advertise" (to the coordinator: an Advertise of one trainer rank for a job of its own,
`count` jobs; the PlanProblems it is told counted, the first messages kept),
"foreign-region" (an Advertise whose engine rank's region names host1), "hello" /
"rejoin" (PeerHello, the same incarnation or a new one each; welcomes and memberships
counted; from a daemon that does not coordinate, its `not_coordinator` errors apart),
"flap" (Heartbeat, a new incarnation and its own in turn).

    python statusflood.py '{"node":"flooder","secret_key":..,"allowed_dir":..,
                            "coordinator":..,"coordinator_key":..,"address":..,
                            "target":"host0","count":20000,"hold_s":5,"kind":"status"}'
"""

from __future__ import annotations

import asyncio
import secrets
import time

from tests.attack.member import joining, main
from weightwire.protocol import PROTOCOL_VERSION
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
from weightwire.protocol.peer import PeerError as Refused
from weightwire.protocol.regions import RegionDescriptor
from weightwire.protocol.tensors import SourceTensor


async def run(spec: dict[str, object]) -> dict[str, object]:
    j = joining(spec)
    node, mesh, incarnation = j.node, j.mesh, j.incarnation
    target = str(spec["target"])
    joined = asyncio.Event()
    answers = not_coordinator = 0
    first = last = 0.0
    problems: dict[str, int] = {}
    told: list[str] = []  # the first PlanProblems' messages

    async def handle(sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        nonlocal answers, not_coordinator, first, last
        match msg:
            case Membership(members=ms):
                answers += joined.is_set()  # kind hello / rejoin: what the hellos cost
                j.learn(ms)
                if target in j.members and node in j.members:
                    joined.set()
            case PeerWelcome() if joined.is_set():
                answers += 1
            case StatusAnswer() if sender == target:
                answers += 1
                last = time.monotonic()
                first = first or last
            case Refused(code="not_coordinator") if sender == target:
                not_coordinator += 1  # kind hello to a daemon that does not coordinate
            case PlanProblem(code=code, message=message):
                problems[code] = problems.get(code, 0) + 1
                if len(told) < 4:
                    told.append(message)

    me = j.me()
    out: dict[str, object] = {"event": "statusflood"}
    j.start(handle, me)
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
                    node=node, endpoint=me.endpoint, incarnation=inc, public_key=me.public_key
                )
                msg = PeerHello(protocol=PROTOCOL_VERSION, member=who)
            elif kind == "foreign-region":  # an engine rank whose region names host1
                area = RegionDescriptor(id=1, node="host1", kind="cpu", length=4096)
                eng = RankAdvert(role="engine", rank=0, world_size=1, regions=(area,))
                msg = Advertise(
                    node=node, incarnation=incarnation, job="foreign-region", ranks=(rank, eng),
                    seq=i + 1,
                )  # fmt: skip
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
            sent=sent,
            answers=answers,
            not_coordinator=not_coordinator,
            answer_span_s=round(last - first, 3),
            problems=problems,
            told=told,
        )
    except Exception as exc:
        out["failed"] = repr(exc)
    finally:
        await j.stop()
    return out


if __name__ == "__main__":
    main(run)
