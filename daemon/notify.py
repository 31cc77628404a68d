"""systemd's notify protocol (Type=notify): READY, STATUS, WATCHDOG and
EXTEND_TIMEOUT_USEC datagrams.

No dependency on libsystemd: a datagram to $NOTIFY_SOCKET. Outside systemd every call
is a no-op. The watchdog is fed from the event loop's own tick, so a wedged loop is
exactly what makes systemd restart the daemon. READY waits for the node to join its
coordinator, which may take any time; until then each STATUS also extends the start
timeout (TimeoutStartSec) by EXTEND_S, so a waiting node is not killed, and one whose loop
is wedged still is.
"""

from __future__ import annotations

import contextlib
import os
import socket

EXTEND_S = 30.0  # each extension of the start timeout; the tick sends one every 5 s


class Notifier:
    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET", "")
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() else 0.0
        if pid and pid.isdigit() and int(pid) != os.getpid():
            self.watchdog_s = 0.0
        self._sock: socket.socket | None = None
        self.readied = False  # READY sent: the start timeout no longer applies

    def send(self, **fields: str) -> None:
        if not self.address:
            return
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        with contextlib.suppress(OSError):  # systemd went away: nothing to tell
            self._sock.sendto(msg, addr)

    def ready(self, status: str) -> None:
        self.readied = True
        self.send(ready="1", status=status, mainpid=str(os.getpid()))

    def waiting(self, status: str) -> None:
        """STATUS, and before READY, EXTEND_TIMEOUT_USEC: not ready yet, but alive."""
        if self.readied:
            self.send(status=status)
        else:
            self.send(status=status, extend_timeout_usec=str(int(EXTEND_S * 1e6)))

    def status(self, status: str) -> None:
        self.send(status=status)

    def watchdog(self) -> None:
        if self.watchdog_s:
            self.send(watchdog="1")

    def stopping(self) -> None:
        self.send(stopping="1", status="stopping")
