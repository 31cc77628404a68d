"""A passive tap on one link: prints, as JSON lines, every tcp data-plane frame header it
can read in clear (DataHello, Write). Run as root inside the namespace that holds the
interface; stops when stdin closes.

    python capture.py IFACE
"""

from __future__ import annotations

import json
import select
import socket
import struct
import sys

import msgspec

from weightwire.transport.tcp.data import PREFIX, DataHello, DataMessage, Write

ETH_P_ALL = 0x0003
_decoder: msgspec.msgpack.Decoder[DataMessage] = msgspec.msgpack.Decoder(DataMessage)


def frames(payload: bytes) -> list[tuple[DataMessage, bytes]]:
    """Data frames whose prefix and header lie whole in one segment, wherever they start."""
    found = []
    for kind in (1, 2):
        for n in range(3, 10):
            needle = b"\x00\x00\x00" + bytes([0x90 | n, kind])
            at = payload.find(needle)
            while at >= 2:
                start = at - 2
                if payload[start] == kind:
                    (hlen,) = struct.unpack_from("<I", payload, start + 1)
                    end = start + PREFIX.size + hlen
                    if 0 < hlen <= 4096 and end <= len(payload):
                        try:
                            msg = _decoder.decode(payload[start + PREFIX.size : end])
                            found.append((msg, payload[start:end]))
                        except (msgspec.DecodeError, msgspec.ValidationError):
                            pass
                at = payload.find(needle, at + 1)
    return found


def main() -> None:
    iface = sys.argv[1]
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((iface, 0))
    print(json.dumps({"event": "listening", "iface": iface}), flush=True)
    seen: set[bytes] = set()
    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [], 1.0)
        if sys.stdin in ready and not sys.stdin.readline():
            return
        if sock not in ready:
            continue
        pkt = sock.recv(1 << 18)
        if len(pkt) < 14 + 20 or pkt[12:14] != b"\x08\x00" or pkt[14 + 9] != 6:
            continue
        ihl = (pkt[14] & 0x0F) * 4
        tcp = 14 + ihl
        payload = pkt[tcp + (pkt[tcp + 12] >> 4) * 4 :]
        for msg, raw in frames(payload):
            if raw in seen:
                continue
            seen.add(raw)
            if isinstance(msg, Write):
                out = {"event": "write", **msgspec.structs.asdict(msg)}
            elif isinstance(msg, DataHello):
                out = {"event": "hello", "node": msg.node, "raw": raw.hex()}
            else:
                continue
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
