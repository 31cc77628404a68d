"""Holds `count` TCP connections to HOST:PORT open without a byte sent, opening a new one
whenever the other end closes one, for `hold_s` seconds; prints how many it opened.

    python silent.py HOST PORT COUNT HOLD_S
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import time


def main() -> None:
    host, port, count, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    sel = selectors.DefaultSelector()
    opened = 0

    def open_one() -> None:
        nonlocal opened
        s = socket.create_connection((host, port))
        sel.register(s, selectors.EVENT_READ)
        opened += 1

    for _ in range(count):
        open_one()
    print(json.dumps({"event": "holding", "count": count}), flush=True)
    deadline = time.monotonic() + hold
    while (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(min(left, 0.1)):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # closed by the daemon: take its place again
                sel.unregister(s)
                s.close()
                open_one()
    print(json.dumps({"event": "done", "opened": opened}), flush=True)


if __name__ == "__main__":
    main()
