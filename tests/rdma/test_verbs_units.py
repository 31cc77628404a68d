"""The parts of the verbs transport that need no RDMA device (they run everywhere): the
pyverbs enum shim for 44 and >= 59, NIC affinity from sysfs, device discovery's messages,
and how the daemon chooses transports from `transport = ...`."""

from __future__ import annotations

import enum
import logging
import os
import types
from pathlib import Path
from typing import Any

import pytest
import structlog

from weightwire.daemon.config import ConfigError, DaemonConfig
from weightwire.daemon.transports import make_transports
from weightwire.transport.verbs import devices as devmod
from weightwire.transport.verbs import ibv, wire
from weightwire.transport.verbs.devices import affine_nics, normalize_bus_id, parse_spec


def test_enum_shim_flattens_44_and_59_layouts() -> None:
    """44: module-level ints in pyverbs.enums. 59 (Cython >= 3.1): named enums only as
    IntEnum classes in libibverbs_enums, anonymous ones module-level. Same values out."""
    old = types.ModuleType("pyverbs.enums")
    old.IBV_QPT_RC = 2  # type: ignore[attr-defined]
    old.IBV_WR_RDMA_WRITE_WITH_IMM = 1  # type: ignore[attr-defined]
    old.IBV_LINK_LAYER_ETHERNET = 2  # type: ignore[attr-defined]
    new = types.ModuleType("pyverbs.libibverbs_enums")
    new.ibv_qp_type = enum.IntEnum("ibv_qp_type", {"IBV_QPT_RC": 2, "IBV_QPT_UD": 4})  # type: ignore[attr-defined]
    new.ibv_wr_opcode = enum.IntEnum(  # type: ignore[attr-defined]
        "ibv_wr_opcode", {"IBV_WR_RDMA_WRITE": 0, "IBV_WR_RDMA_WRITE_WITH_IMM": 1}
    )
    new.IBV_LINK_LAYER_ETHERNET = 2  # type: ignore[attr-defined]
    a, b = ibv.flatten(old), ibv.flatten(new)
    for name in ("IBV_QPT_RC", "IBV_WR_RDMA_WRITE_WITH_IMM", "IBV_LINK_LAYER_ETHERNET"):
        assert getattr(a, name) == getattr(b, name)
        assert type(getattr(b, name)) is int
    assert b.IBV_QPT_UD == 4 and "IBV_QPT_UD" not in a
    with pytest.raises(AttributeError, match="IBV_NOPE"):
        _ = a.IBV_NOPE


def _pci(root: Path, *parts: str, numa: int) -> Path:
    p = root / "devices" / Path(*parts)
    p.mkdir(parents=True, exist_ok=True)
    (p / "numa_node").write_text(f"{numa}\n")
    return p


def _sysfs(tmp_path: Path) -> Path:
    """Two sockets; socket 0 has a PCIe switch with GPU0, mlx5_0 and mlx5_1 behind it;
    GPU1 and mlx5_2 hang off another root port of socket 0; mlx5_3 is on socket 1."""
    root = tmp_path / "sys"
    sw = ("pci0000:00", "0000:00:01.0", "0000:01:00.0")
    gpu0 = _pci(root, *sw, "0000:02:00.0", "0000:03:00.0", numa=0)
    nic0 = _pci(root, *sw, "0000:02:01.0", "0000:04:00.0", numa=0)
    nic1 = _pci(root, *sw, "0000:02:02.0", "0000:05:00.0", numa=0)
    gpu1 = _pci(root, "pci0000:00", "0000:00:02.0", "0000:06:00.0", numa=0)
    nic2 = _pci(root, "pci0000:00", "0000:00:03.0", "0000:07:00.0", numa=0)
    nic3 = _pci(root, "pci0000:80", "0000:80:01.0", "0000:81:00.0", numa=1)
    gpu2 = _pci(root, "pci0000:c0", "0000:c0:01.0", "0000:c1:00.0", numa=-1)
    bus = root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for g in (gpu0, gpu1, gpu2):
        (bus / g.name).symlink_to(g)
    for i, n in enumerate((nic0, nic1, nic2, nic3)):
        d = root / "class" / "infiniband" / f"mlx5_{i}"
        d.mkdir(parents=True)
        (d / "device").symlink_to(n)
    return root


def test_nics_of_a_gpu_from_pcie_and_numa(tmp_path: Path) -> None:
    root = str(_sysfs(tmp_path))
    names = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"]
    nics = {n: devmod.pci_path_of_nic(n, root) for n in names}
    assert nics["rxe0"] is None  # a software device has no PCI parent
    gpu0 = devmod.pci_path_of_bus_id("00000000:03:00.0", root)
    gpu1 = devmod.pci_path_of_bus_id("0000:06:00.0", root)
    gpu2 = devmod.pci_path_of_bus_id("0000:C1:00.0", root)
    assert affine_nics(gpu0, nics) == ["mlx5_0", "mlx5_1"]  # behind the same switch
    assert affine_nics(gpu1, nics) == ["mlx5_0", "mlx5_1", "mlx5_2"]  # same NUMA node
    assert affine_nics(gpu2, nics) == names  # nothing known: every NIC
    assert affine_nics(None, nics) == names


def test_bus_ids_and_device_specs() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.1") == "0000:3b:00.1"
    with pytest.raises(ValueError):
        normalize_bus_id("GPU-0")
    assert parse_spec("mlx5_0") == ("mlx5_0", 1)
    assert parse_spec("mlx5_1:2") == ("mlx5_1", 2)
    with pytest.raises(ibv.VerbsUnavailable):
        parse_spec("mlx5_1:x")


class _FakeError(Exception):
    error_code = -1


def _fake_api(devices: list[tuple[str, int]] | Exception) -> Any:
    """Enough of pyverbs for discovery: device names with a port state each."""
    E = ibv.Enums(
        {"IBV_PORT_ACTIVE": 4, "IBV_LINK_LAYER_ETHERNET": 2, "IBV_GID_TYPE_SYSFS_ROCE_V2": 1}
    )
    states = dict(devices) if isinstance(devices, list) else {}

    def get_device_list() -> list[Any]:
        if isinstance(devices, Exception):
            raise devices
        return [types.SimpleNamespace(name=n.encode()) for n, _ in devices]

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def query_port(self, port: int) -> Any:
            return types.SimpleNamespace(
                state=states[self.name], link_layer=2, active_mtu=5, max_msg_sz=1 << 23,
                gid_tbl_len=4, lid=0,
            )  # fmt: skip

        def query_device(self) -> Any:
            return types.SimpleNamespace(max_qp_wr=1024, max_cqe=4096, max_mr_size=1 << 40)

        def query_gid(self, port: int, idx: int) -> str:
            return ["fe80:0000:0000:0000:0000:0000:0000:0001",
                    "0000:0000:0000:0000:0000:ffff:0ae9:0001",
                    "0000:0000:0000:0000:0000:0000:0000:0000",
                    "0000:0000:0000:0000:0000:0000:0000:0000"][idx]  # fmt: skip

        def query_gid_type(self, port: int, idx: int) -> int:
            return 1

        def close(self) -> None:
            pass

    return types.SimpleNamespace(
        E=E, Error=_FakeError, get_device_list=get_device_list, Context=lambda name: Ctx(name)
    )


def test_discovery_messages_name_the_alternative() -> None:
    none = _fake_api(_FakeError("Failed to get devices list"))
    with pytest.raises(ibv.VerbsUnavailable, match=r'no RDMA device.*transport = "tcp"'):
        devmod.discover(api=none)
    down = _fake_api([("mlx5_0", 1)])
    with pytest.raises(ibv.VerbsUnavailable, match=r'mlx5_0 \(state 1\).*transport = "tcp"'):
        devmod.discover(api=down)
    with pytest.raises(ibv.VerbsUnavailable, match="mlx5_9 not found"):
        devmod.discover(["mlx5_9"], api=_fake_api([("mlx5_0", 4)]))
    (info,) = devmod.discover(api=_fake_api([("mlx5_0", 1), ("mlx5_1", 4)]))
    assert info.name == "mlx5_1" and info.gid_index == 1  # RoCE v2, IPv4-mapped
    assert info.gid.endswith("ffff:0ae9:0001")


def _no_rdma(monkeypatch: pytest.MonkeyPatch) -> None:
    def load() -> Any:
        raise ibv.VerbsUnavailable(f"no RDMA device on this machine; {devmod.ALTERNATIVE}")

    monkeypatch.setattr("weightwire.transport.verbs.transport.load", load)


def test_transport_verbs_without_rdma_is_a_clear_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_rdma(monkeypatch)
    cfg = DaemonConfig(node="n", is_coordinator=True, transport="verbs", cuda="off")
    with pytest.raises(ConfigError, match=r'transport = "verbs" but .*transport = "tcp"'):
        make_transports(cfg)


def test_transport_auto_without_rdma_falls_back_to_tcp_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_rdma(monkeypatch)
    with structlog.testing.capture_logs() as logs:
        auto = make_transports(DaemonConfig(node="n", transport="auto", cuda="off"))
    assert [t.name for t in auto] == ["tcp"]
    why = [e for e in logs if "tcp" in e["event"]]
    assert len(why) == 1 and "no RDMA device" in why[0]["reason"], logs
    tcp_only = make_transports(DaemonConfig(node="n", transport="tcp", cuda="off"))
    assert [t.name for t in tcp_only] == ["tcp"]


def test_real_discovery_here_never_raises_anything_else() -> None:
    ok, why = devmod.available()
    assert ok or why, "available() must say why not"
    logging.getLogger(__name__).info("verbs here: %s", why or "available")


def test_bring_up_messages_round_trip() -> None:
    path = wire.Path(device="rxe1", gid="0000:0000:0000:0000:0000:ffff:0ae9:0001", mtu=5)
    msg = wire.Connect(
        link=(1 << 63) - 1, src=path, dst_device="rxe2", qps=(wire.QpInfo(17, 0xFFFFFF),)
    )
    assert wire.decode_request(wire.encode(msg)) == msg
    chk = wire.Check(region=3, device="rxe2", addr=(1 << 64) - 1, rkey=(1 << 32) - 1, length=5)
    assert wire.decode_request(wire.encode(chk)) == chk
    assert isinstance(wire.decode_reply(wire.encode(wire.Checked())), wire.Checked)
    with pytest.raises(Exception):  # noqa: B017 - msgspec's own error types
        wire.decode_request(wire.encode(wire.Checked()))
    assert os.environ.get("WEIGHTWIRE_VERBS_FAULT_FILE") is None
