"""A third host with no key at all: it opens its own tcp connection to a daemon's data
port, claims another node's name (or replays a captured hello), and sends writes with a
captured region id and rkey, 0xFF payloads and immediates. Prints one JSON line per
attempt: what came back (acks, a refusal) before the connection closed.

    python forge.py HOST PORT '{"region":..,"rkey":..,"offset":..,"imm":..,"claim":"host0",
                                "length":65536,"count":1,"replay":"<hex of a hello>"}'
"""

from __future__ import annotations

import json
import socket
import sys
import time

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.transport.tcp import wire
from weightwire.transport.tcp.data import PREFIX, Ack, DataHello, Refused, Write


def attempt(host: str, port: int, spec: dict[str, object], replay: bool) -> dict[str, object]:
    sock = socket.create_connection((host, port), timeout=10)
    sock.settimeout(8)
    out: dict[str, object] = {"event": "attempt", "replay": replay, "acks": 0, "refused": None}
    try:
        if replay:
            sock.sendall(bytes.fromhex(str(spec["replay"])))
            sock.sendall(wire.encode(wire.Proof(proof=b"\x00" * 32)))  # it cannot make one
        else:
            sock.sendall(wire.encode(DataHello(protocol=PROTOCOL_VERSION, node=str(spec["claim"]))))
        length = int(spec.get("length", 65536))  # type: ignore[call-overload]
        for i in range(int(spec.get("count", 1))):  # type: ignore[call-overload]
            write = Write(
                seq=1000 + i,
                region=int(spec["region"]),  # type: ignore[call-overload]
                rkey=int(spec["rkey"]),  # type: ignore[call-overload]
                offset=int(spec["offset"]),  # type: ignore[call-overload]
                length=length,
                imm=int(spec["imm"]),  # type: ignore[call-overload]
            )
            sock.sendall(wire.encode(write) + b"\xff" * length)
        deadline = time.monotonic() + 8
        buf = b""
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= PREFIX.size:
                kind, hlen = PREFIX.unpack(buf[: PREFIX.size])
                if len(buf) < PREFIX.size + hlen:
                    break
                try:
                    msg = wire.decode_header(kind, buf[PREFIX.size : PREFIX.size + hlen])
                except Exception as exc:  # a sealed frame it cannot read: count as not acked
                    out["unreadable"] = repr(exc)
                    buf = b""
                    break
                buf = buf[PREFIX.size + hlen :]
                if isinstance(msg, Ack):
                    out["acks"] = int(out["acks"]) + 1  # type: ignore[call-overload]
                elif isinstance(msg, Refused):
                    out["refused"] = {"code": msg.code, "message": msg.message}
    except OSError as exc:
        out["error"] = repr(exc)
    finally:
        sock.close()
    return out


def main() -> None:
    host, port, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    print(json.dumps(attempt(host, port, spec, replay=False)), flush=True)
    if spec.get("replay"):
        print(json.dumps(attempt(host, port, spec, replay=True)), flush=True)


if __name__ == "__main__":
    main()
