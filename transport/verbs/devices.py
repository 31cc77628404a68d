"""RDMA device discovery, GID choice, and which NICs serve which GPU (PCIe/NUMA affinity).

Discovery opens each device once, reads its port and limits, and closes it again. The
affinity functions only read sysfs (a root can be given, for tests).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .ibv import Api, VerbsUnavailable, load

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
V4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
ALTERNATIVE = 'set transport = "tcp" to move weights over TCP instead'


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    port: int
    active: bool
    state: int
    ethernet: bool  # RoCE (link layer Ethernet) rather than InfiniBand
    active_mtu: int  # IBV_MTU_* enum (5 = 4096 bytes)
    max_msg_sz: int
    gid_index: int
    gid: str  # as pyverbs prints it; GID(text) rebuilds it
    lid: int
    max_qp_wr: int
    max_cqe: int
    max_mr_size: int

    def describe(self) -> str:
        link = "RoCE" if self.ethernet else "InfiniBand"
        return (
            f"{self.name} port {self.port}: {link}, mtu {MTU_BYTES.get(self.active_mtu, '?')}, "
            f"gid[{self.gid_index}] {self.gid}, max message {self.max_msg_sz} bytes"
        )


def parse_spec(spec: str) -> tuple[str, int]:
    """`mlx5_0` or `mlx5_0:2` (a port other than 1)."""
    name, _, port = spec.strip().partition(":")
    if not name:
        raise VerbsUnavailable(f"empty RDMA device name in {spec!r}")
    try:
        return name, int(port) if port else 1
    except ValueError:
        raise VerbsUnavailable(
            f"bad RDMA device {spec!r}: the port after ':' is a number"
        ) from None


def device_names(api: Api) -> list[str]:
    """Every RDMA device the kernel has (none: pyverbs raises, which means the same)."""
    try:
        devs = api.get_device_list()
    except api.Error:
        return []
    return sorted(
        (d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs),
        key=_natural,
    )


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def pick_gid(api: Api, ctx: object, port: int, want: int, table: int) -> tuple[int, str]:
    """`want` >= 0: that index. Otherwise a RoCE v2 GID, IPv4-mapped preferred (index 0,
    the fe80:: link-local one, is not routable on rxe and is only a fallback)."""
    E = api.E
    best: tuple[int, int, str] | None = None
    for idx in range(min(table, 256)) if want < 0 else (want,):
        try:
            text = str(ctx.query_gid(port, idx))  # type: ignore[attr-defined]
        except api.Error:
            continue
        if text == ZERO_GID:
            continue
        try:
            gtype = int(ctx.query_gid_type(port, idx))  # type: ignore[attr-defined]
        except api.Error:
            gtype = -1
        if want >= 0:
            return idx, text
        v2 = gtype == E.get("IBV_GID_TYPE_SYSFS_ROCE_V2", E.get("IBV_GID_TYPE_ROCE_V2", 1))
        score = (4 if v2 else 0) + (2 if text.startswith(V4_MAPPED) else 0) + (idx != 0)
        if best is None or score > best[0]:
            best = (score, idx, text)
    if best is None:
        which = f"index {want}" if want >= 0 else "any index"
        raise VerbsUnavailable(f"no usable GID at {which} on port {port}")
    return best[1], best[2]


def probe(api: Api, name: str, port: int = 1, gid_index: int = -1) -> DeviceInfo:
    """Open `name`, read its port and limits, close it."""
    E = api.E
    try:
        ctx = api.Context(name=name)
    except api.Error as exc:
        raise VerbsUnavailable(f"cannot open RDMA device {name}: {exc}") from None
    try:
        pattr = ctx.query_port(port)
        dattr = ctx.query_device()
        active = int(pattr.state) == E.IBV_PORT_ACTIVE
        ethernet = int(pattr.link_layer) == E.get("IBV_LINK_LAYER_ETHERNET", 2)
        try:
            gidx, gid = pick_gid(api, ctx, port, gid_index, int(pattr.gid_tbl_len))
        except VerbsUnavailable:
            if active:
                raise
            gidx, gid = -1, ZERO_GID
        return DeviceInfo(
            name=name,
            port=port,
            active=active,
            state=int(pattr.state),
            ethernet=ethernet,
            active_mtu=int(pattr.active_mtu),
            max_msg_sz=int(pattr.max_msg_sz),
            gid_index=gidx,
            gid=gid,
            lid=int(getattr(pattr, "lid", 0)),
            max_qp_wr=int(dattr.max_qp_wr),
            max_cqe=int(dattr.max_cqe),
            max_mr_size=int(dattr.max_mr_size),
        )
    except api.Error as exc:
        raise VerbsUnavailable(f"cannot query RDMA device {name} port {port}: {exc}") from None
    finally:
        ctx.close()


def discover(
    wanted: Iterable[str] = (), gid_index: int = -1, api: Api | None = None
) -> list[DeviceInfo]:
    """The active devices to use: those named in `wanted` (all must be active), or every
    active one. VerbsUnavailable, naming the alternative, when there is none."""
    api = api or load()
    names = device_names(api)
    specs = [parse_spec(s) for s in wanted if s.strip()]
    if not names:
        raise VerbsUnavailable(f"no RDMA device on this machine; {ALTERNATIVE}")
    if specs:
        missing = [n for n, _ in specs if n not in names]
        if missing:
            raise VerbsUnavailable(
                f"RDMA device(s) {', '.join(missing)} not found (have: {', '.join(names)}); "
                f"fix verbs_devices or {ALTERNATIVE}"
            )
        found = [probe(api, n, p, gid_index) for n, p in specs]
        down = [d for d in found if not d.active]
        if down:
            raise VerbsUnavailable(
                "RDMA device(s) "
                + ", ".join(f"{d.name} port {d.port} (state {d.state})" for d in down)
                + f" not ACTIVE; {ALTERNATIVE}"
            )
        return found
    found = []
    for n in names:
        try:
            found.append(probe(api, n, 1, gid_index))
        except VerbsUnavailable:
            continue
    active = [d for d in found if d.active]
    if not active:
        states = ", ".join(f"{d.name} (state {d.state})" for d in found) or ", ".join(names)
        raise VerbsUnavailable(f"no RDMA device has an ACTIVE port: {states}; {ALTERNATIVE}")
    return active


def available(wanted: Iterable[str] = (), gid_index: int = -1) -> tuple[bool, str]:
    """Whether the verbs transport can run here, and why not."""
    try:
        discover(wanted, gid_index)
    except VerbsUnavailable as exc:
        return False, exc.message
    return True, ""


# --- affinity: which NICs are closest to a GPU ---------------------------------------------


def normalize_bus_id(bus_id: str) -> str:
    """`00000000:3B:00.0` / `0000:3b:00.0` -> `0000:3b:00.0` (sysfs spelling)."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id.strip())
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def pci_path_of_bus_id(bus_id: str, sysfs: str = "/sys") -> str | None:
    path = os.path.join(sysfs, "bus", "pci", "devices", normalize_bus_id(bus_id))
    return os.path.realpath(path) if os.path.exists(path) else None


def pci_path_of_nic(name: str, sysfs: str = "/sys") -> str | None:
    """The PCI device behind an RDMA device (None for software devices such as rxe)."""
    path = os.path.join(sysfs, "class", "infiniband", name, "device")
    return os.path.realpath(path) if os.path.exists(path) else None


def numa_node(pci_path: str | None) -> int:
    if pci_path is None:
        return -1
    try:
        with open(os.path.join(pci_path, "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def _pci_components(path: str) -> list[str]:
    """The PCI hierarchy of a sysfs device path: root complex, ports, switches, device."""
    parts = [p for p in path.split(os.sep) if p]
    for i, p in enumerate(parts):
        if p.startswith("pci"):
            return parts[i:]
    return []


def affine_nics(gpu_path: str | None, nics: dict[str, str | None]) -> list[str]:
    """The NICs closest to a GPU, best first: those sharing the deepest PCIe ancestor (a
    switch beats the root port, which beats only the root complex), then the same NUMA
    node. With no usable information, every NIC. Ties keep their natural order."""
    names = sorted(nics, key=_natural)
    if gpu_path is None or not names:
        return names
    gpu = _pci_components(gpu_path)
    gpu_numa = numa_node(gpu_path)

    def score(name: str) -> tuple[int, int]:
        path = nics[name]
        if path is None:
            return (0, 0)
        comps = _pci_components(path)
        depth = 0
        for a, b in zip(gpu, comps, strict=False):
            if a != b:
                break
            depth += 1
        same_numa = int(gpu_numa >= 0 and numa_node(path) == gpu_numa)
        # depth 1 = the same root complex only: no closer than NUMA locality says
        return (depth if depth >= 2 else 0, same_numa)

    scores = {n: score(n) for n in names}
    best = max(scores.values())
    if best == (0, 0):
        return names
    return [n for n in names if scores[n] == best]
