"""An insider: a process holding a key every daemon allows, speaking the peer protocol under
whatever routing id it likes. Sends the given messages (JSON, decoded as PeerMessage) to one
daemon's peer socket once it is connected, keeps the connection open for --hold seconds,
and prints one JSON line per reply it receives."""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import zmq
import zmq.auth

from weightwire.protocol.frames import Codec
from weightwire.protocol.peer import PeerMessage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--server-key", required=True)
    ap.add_argument("--key-file", required=True, help="the insider's NAME.key_secret")
    ap.add_argument("--identity", required=True, help="the ZeroMQ routing id it claims")
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=1, help="send each message this many times")
    ap.add_argument("--every", type=float, default=0.0, help="seconds between repeats")
    ap.add_argument("messages", nargs="+", help="peer messages as JSON objects")
    args = ap.parse_args()
    public, secret = zmq.auth.load_certificate(args.key_file)
    codec = Codec(PeerMessage)
    msgs = [msgspec.json.decode(m.encode(), type=PeerMessage) for m in args.messages]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, args.identity.encode())
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = args.server_key.encode()
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(args.endpoint)
    if not monitor.poll(10_000):
        raise SystemExit("the CURVE handshake did not succeed in 10 s")
    sock.disable_monitor()
    monitor.close()
    for i in range(args.repeat):  # "sent" once the first round is: the caller goes on
        if i and args.every:
            time.sleep(args.every)
        for msg in msgs:
            sock.send_multipart(codec.encode(msg))
        if i == 0:
            print(json.dumps({"event": "sent", "t": time.time(), "count": len(msgs)}), flush=True)
    deadline = time.monotonic() + args.hold
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            reply, _ = codec.decode(sock.recv_multipart())
            print(json.dumps({"event": "reply", "type": type(reply).__name__}), flush=True)
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
