"""pyverbs, loaded lazily, with one namespace of enum ints for every pyverbs version.

pyverbs 44 (Debian 12) has module-level ints in `pyverbs.enums`; pyverbs 57 has both
`pyverbs.enums` and `pyverbs.libibverbs_enums`; 59 and later only `libibverbs_enums`, where
(built with Cython >= 3.1) the named enums are reachable only through their IntEnum class
(`ibv_qp_type.IBV_QPT_RC`). `flatten()` turns any of these into plain ints by name.

Nothing here imports pyverbs at module import time: the daemon imports this module on
machines without RDMA, where `load()` raises `VerbsUnavailable` with the reason.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from weightwire.protocol.errors import ErrorCode, TransferError


class VerbsUnavailable(TransferError):
    """This machine cannot run the verbs transport (no pyverbs, no active RDMA device)."""

    code = ErrorCode.INVALID


class Enums:
    """Every `IBV_*` constant of the loaded pyverbs, as plain ints (attribute access)."""

    def __init__(self, values: dict[str, int]) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"pyverbs has no enum {name}") from None

    def get(self, name: str, default: int = 0) -> int:
        return self._values.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __len__(self) -> int:
        return len(self._values)


def flatten(*modules: ModuleType) -> Enums:
    """Module-level `IBV_*` ints, then the members of every enum class (first one wins)."""
    flat: dict[str, int] = {}
    for mod in modules:
        for name, val in vars(mod).items():
            if name.startswith("IBV_") and isinstance(val, int):
                flat.setdefault(name, int(val))
        for val in vars(mod).values():
            members = getattr(val, "__members__", None)
            if isinstance(val, type) and isinstance(members, Mapping):  # a mappingproxy
                for mname, mval in members.items():
                    if mname.startswith("IBV_"):
                        flat.setdefault(mname, int(mval))
    return Enums(flat)


def _enum_modules() -> list[ModuleType]:
    mods: list[ModuleType] = []
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums"):  # >= 57, <= 58
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            continue
    return mods


@dataclass(frozen=True)
class Api:
    """The pyverbs classes the transport uses (typed Any: pyverbs ships no type hints)."""

    version: str
    E: Enums
    Context: Any
    get_device_list: Any
    PD: Any
    MR: Any
    DmaBufMR: Any
    CQ: Any
    CompChannel: Any
    QP: Any
    QPInitAttr: Any
    QPCap: Any
    QPAttr: Any
    AHAttr: Any
    GlobalRoute: Any
    GID: Any
    SendWR: Any
    RecvWR: Any
    SGE: Any
    Error: type[Exception]  # PyverbsError: base of everything pyverbs raises
    RDMAError: type[Exception]  # PyverbsRDMAError (.error_code: errno or -1)

    def status_text(self, status: int) -> str:
        try:
            cq = importlib.import_module("pyverbs.cq")
            return str(cq.cqe_status_to_str(status))
        except (ImportError, AttributeError):
            return f"status {status}"


_api: Api | None = None
_why: str = ""
_lock = threading.Lock()


def load() -> Api:
    """pyverbs (imported once per process); VerbsUnavailable says why not."""
    global _api, _why
    with _lock:
        if _api is None and not _why:
            try:
                _api = _import()
            except ImportError as exc:
                _why = (
                    f"pyverbs cannot be imported ({exc}); install rdma-core's Python bindings "
                    "(Debian/Ubuntu: apt install python3-pyverbs, in the interpreter that "
                    "runs weightwired)"
                )
        if _api is None:
            raise VerbsUnavailable(_why)
        return _api


def _import() -> Api:
    mods = _enum_modules()
    if not mods:
        raise ImportError("neither pyverbs.libibverbs_enums nor pyverbs.enums")
    pyverbs = importlib.import_module("pyverbs")
    addr = importlib.import_module("pyverbs.addr")
    cq = importlib.import_module("pyverbs.cq")
    device = importlib.import_module("pyverbs.device")
    mr = importlib.import_module("pyverbs.mr")
    pd = importlib.import_module("pyverbs.pd")
    qp = importlib.import_module("pyverbs.qp")
    wr = importlib.import_module("pyverbs.wr")
    err = importlib.import_module("pyverbs.pyverbs_error")
    return Api(
        version=str(getattr(pyverbs, "__version__", "?")),
        E=flatten(*mods),
        Context=device.Context,
        get_device_list=device.get_device_list,
        PD=pd.PD,
        MR=mr.MR,
        DmaBufMR=getattr(mr, "DmaBufMR", None),
        CQ=cq.CQ,
        CompChannel=cq.CompChannel,
        QP=qp.QP,
        QPInitAttr=qp.QPInitAttr,
        QPCap=qp.QPCap,
        QPAttr=qp.QPAttr,
        AHAttr=addr.AHAttr,
        GlobalRoute=addr.GlobalRoute,
        GID=addr.GID,
        SendWR=wr.SendWR,
        RecvWR=wr.RecvWR,
        SGE=wr.SGE,
        Error=err.PyverbsError,
        RDMAError=err.PyverbsRDMAError,
    )


def errno_of(exc: BaseException) -> int:
    """The errno a PyverbsRDMAError carries (-1 when pyverbs did not pass it on)."""
    code = getattr(exc, "error_code", -1)
    return int(code) if isinstance(code, int) else -1
