"""Hosts on one machine: network namespaces with their own addresses, joined by a bridge.

Needs root. Every name carries a per-run tag so parallel runs never collide, and
`close()` (also at exit) removes all of it.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and why not."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need root"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is missing"
    probe = f"ww-probe-{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass
class Hosts:
    """`count` namespaces, host i at 10.<subnet>.0.<i+1>/24 on one bridge."""

    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = field(default_factory=lambda: 100 + secrets.randbelow(100))
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    mtu: int = 9000

    def __post_init__(self) -> None:
        self.switch = f"ww-{self.tag}-sw"
        atexit.register(self.close)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.count):
            ns = f"ww-{self.tag}-h{i}"
            addr = f"10.{self.subnet}.0.{i + 1}"
            _ip("netns", "add", ns)
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                self.switch,
                "mtu",
                str(self.mtu),
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.names.append(ns)
            self.addresses.append(addr)

    def throttle(self, i: int, mbit: int) -> None:
        """Limit what host i sends to `mbit` Mbit/s (to make transfers last, for fault tests)."""
        _ip(
            "netns",
            "exec",
            self.names[i],
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            "256kb",
            "latency",
            "100ms",
        )

    def shape(self, i: int, gbps: float) -> None:
        """Limit what host i sends to `gbps` Gbit/s, as a NIC of that rate would: a token
        bucket whose burst is 2 ms at that rate (a smaller one caps high rates at burst x
        the kernel's tick rate)."""
        burst = max(256 << 10, int(gbps * 1e9 / 8 * 0.002))
        _ip(
            "netns", "exec", self.names[i], "tc", "qdisc", "replace", "dev", "eth0", "root",
            "tbf", "rate", f"{round(gbps * 1000)}mbit", "burst", str(burst), "latency", "50ms",
        )  # fmt: skip

    def unshape(self, i: int) -> None:
        """Host i sends at whatever speed veth gives again."""
        subprocess.run(
            ["ip", "netns", "exec", self.names[i], "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
        )

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def close(self) -> None:
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names.clear()
        self.switch = ""
