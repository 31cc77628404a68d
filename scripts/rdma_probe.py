#!/usr/bin/env python3
"""Standalone pyverbs probe: real RC RDMA WRITE / WRITE_WITH_IMM on a (Soft-)RoCE device.

Stdlib + pyverbs only. Run it inside the Soft-RoCE VM:

    scripts/rdma-vm.sh -- .venv-rdma/bin/python scripts/rdma_probe.py
    scripts/rdma-vm.sh -- .venv-rdma/bin/python scripts/rdma_probe.py --dev-a rxe0 --dev-b rxe1

What it does (each step prints one line; exit 0 only if every check passed):
  1. device discovery (no device at all -> exit 77, "skip"), port state, active MTU, GID choice
  2. one PD, two MRs over caller-owned memory (mmap) with LOCAL_WRITE|REMOTE_WRITE
  3. two RC QPs in this process, RESET->INIT->RTR->RTS with explicit attribute masks
  4. a multi-MB RDMA WRITE as a chain of work requests, the last one WRITE_WITH_IMM, polled CQs,
     bitwise check of the target buffer and of the immediate value
  5. the same transfer with a completion channel: (a) select() on the channel fd, then
     get_cq_event(); (b) a thread blocking in get_cq_event() (run in a child process with a
     watchdog because pyverbs does not release the GIL there)
  6. error completions (wrong rkey, out-of-bounds remote address): status, QP states, recovery
     RESET->INIT->RTR->RTS, and a good transfer afterwards

Works with pyverbs 44 (Debian 12: enums in `pyverbs.enums`) and pyverbs >= 59 (enums in
`pyverbs.libibverbs_enums`, possibly only as IntEnum classes): see `load_enums()`.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import faulthandler
import fcntl
import mmap
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any


# ----------------------------------------------------------------------------------------------
# Enum shim: pyverbs 44 exposes module-level ints in `pyverbs.enums`; pyverbs >= 57 has
# `pyverbs.libibverbs_enums` (and 59 dropped `pyverbs.enums`). Built with Cython >= 3.1, the
# named `cpdef enum`s are only reachable through their IntEnum class (ibv_qp_type.IBV_QPT_RC), so
# flatten every enum class into one namespace of plain ints.
# ----------------------------------------------------------------------------------------------
def load_enums() -> SimpleNamespace:
    try:
        import pyverbs.libibverbs_enums as mod  # pyverbs >= 57
    except ImportError:
        import pyverbs.enums as mod  # pyverbs <= 58 (Debian 12: 44)
    flat: dict[str, int] = {}
    for name, val in vars(mod).items():
        if name.startswith("IBV_") and isinstance(val, int):
            flat[name] = int(val)
        elif isinstance(val, type) and hasattr(val, "__members__"):
            for mname, mval in val.__members__.items():
                if mname.startswith("IBV_"):
                    flat.setdefault(mname, int(mval))
    return SimpleNamespace(**flat)


E = load_enums()

from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ, CompChannel  # noqa: E402
from pyverbs.device import Context, get_device_list  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

try:
    from pyverbs.cq import cqe_status_to_str
except ImportError:  # pragma: no cover

    def cqe_status_to_str(status: int) -> str:
        return str(status)


PORT = 1
FAILS: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)


def check(ok: bool, what: str) -> bool:
    say(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILS.append(what)
    return ok


def wc_str(wc: Any) -> str:
    return (
        f"wr_id={wc.wr_id} status={wc.status}({cqe_status_to_str(wc.status)}) opcode={wc.opcode} "
        f"byte_len={wc.byte_len} imm_data=0x{wc.imm_data:08x} wc_flags=0x{wc.wc_flags:x} "
        f"qp_num={wc.qp_num} vendor_err={wc.vendor_err}"
    )


QPS_NAMES = {
    getattr(E, n): n[len("IBV_QPS_") :]
    for n in (
        "IBV_QPS_RESET",
        "IBV_QPS_INIT",
        "IBV_QPS_RTR",
        "IBV_QPS_RTS",
        "IBV_QPS_SQD",
        "IBV_QPS_SQE",
        "IBV_QPS_ERR",
        "IBV_QPS_UNKNOWN",
    )
    if hasattr(E, n)
}
MTU_BYTES = {
    E.IBV_MTU_256: 256,
    E.IBV_MTU_512: 512,
    E.IBV_MTU_1024: 1024,
    E.IBV_MTU_2048: 2048,
    E.IBV_MTU_4096: 4096,
}


# ----------------------------------------------------------------------------------------------
# Device discovery
# ----------------------------------------------------------------------------------------------
def list_devices() -> list[str]:
    """Names of RDMA devices. pyverbs raises PyverbsRDMAError(ENOSYS) when there are none."""
    try:
        devs = get_device_list()
    except PyverbsRDMAError as exc:
        say(f"get_device_list() raised PyverbsRDMAError errno={exc.error_code} ({exc})")
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


def pick_gid(ctx: Context, port: int, want: int | None) -> tuple[int, GID, str]:
    """Pick a RoCE v2 GID, preferring an IPv4-mapped one (::ffff:a.b.c.d)."""
    pattr = ctx.query_port(port)
    best: tuple[int, int, GID, str] | None = None
    for idx in range(min(pattr.gid_tbl_len, 256)):
        try:
            gid = ctx.query_gid(port, idx)
        except PyverbsRDMAError:
            continue
        text = str(gid)
        if text == "0000:0000:0000:0000:0000:0000:0000:0000":
            continue
        try:
            gtype = ctx.query_gid_type(port, idx)
        except PyverbsError:
            continue
        v2 = gtype == E.IBV_GID_TYPE_SYSFS_ROCE_V2
        kind = "RoCEv2" if v2 else "IB/RoCEv1"
        if want is not None:
            if idx == want:
                return idx, gid, kind
            continue
        score = (2 if v2 else 0) + (1 if text.startswith("0000:0000:0000:0000:0000:ffff:") else 0)
        if best is None or score > best[0]:
            best = (score, idx, gid, kind)
    if best is None:
        raise SystemExit(f"no usable GID on port {port} (wanted index {want})")
    return best[1], best[2], best[3]


class Side:
    """Everything one end of the connection owns (ctx/pd shared when both ends use one device)."""

    def __init__(
        self,
        name: str,
        ctx: Context,
        pd: PD,
        gid_index: int | None,
        size: int,
        depth: int,
        channel: CompChannel | None = None,
    ):
        self.name = name
        self.ctx, self.pd = ctx, pd
        self.gid_index, self.gid, self.gid_kind = pick_gid(ctx, PORT, gid_index)
        pattr = ctx.query_port(PORT)
        self.active_mtu = pattr.active_mtu
        # Caller-owned memory (what the transport will do with torch/numpy buffers): mmap is
        # page-aligned; ctypes gives its address; MR(address=...) registers it without copying.
        self.mem = mmap.mmap(-1, size)
        self._cbuf = (ctypes.c_char * size).from_buffer(self.mem)
        self.addr = ctypes.addressof(self._cbuf)
        t0 = time.perf_counter()
        access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
        self.mr = MR(pd, size, access, address=self.addr)
        self.reg_s = time.perf_counter() - t0
        # A small MR for the receive WR that a WRITE_WITH_IMM consumes (pyverbs' RecvWR refuses
        # num_sge=0, so give it one real SGE; nothing is written there by WRITE_WITH_IMM).
        self.scratch = MR(pd, 64, E.IBV_ACCESS_LOCAL_WRITE)
        self.cq = CQ(ctx, 2 * depth + 8, None, channel, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        # sq_sig_all=0: only WRs posted with IBV_SEND_SIGNALED produce a success completion.
        init = QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = QP(pd, init)
        self.psn = random.getrandbits(24)

    def info(self) -> dict[str, Any]:
        # What a real peer would send over the control channel.
        return {
            "qpn": self.qp.qp_num,
            "psn": self.psn,
            "gid": str(self.gid),
            "addr": self.addr,
            "rkey": self.mr.rkey,
            "len": self.mr.length,
        }

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.scratch, self.mr):
            obj.close()
        del self._cbuf
        self.mem.close()


def qp_state(qp: QP) -> str:
    """The real state (qp.qp_state is only libibverbs' cached value: it misses async ERR)."""
    attr, _ = qp.query(E.IBV_QP_STATE)
    return QPS_NAMES.get(attr.qp_state, str(attr.qp_state))


def connect(local: Side, remote: dict[str, Any], mtu: int) -> None:
    """RESET -> INIT -> RTR -> RTS with explicit masks (same as QP.to_rts() but visible)."""
    qp = local.qp
    a = QPAttr()
    a.qp_state = E.IBV_QPS_INIT
    a.pkey_index = 0
    a.port_num = PORT
    a.qp_access_flags = (
        E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
    )
    qp.modify(a, E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT | E.IBV_QP_ACCESS_FLAGS)

    a = QPAttr()
    a.qp_state = E.IBV_QPS_RTR
    a.path_mtu = mtu
    a.dest_qp_num = remote["qpn"]
    a.rq_psn = remote["psn"]
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 12
    gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=local.gid_index, hop_limit=64)
    a.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, sl=0, dlid=0)
    qp.modify(
        a,
        E.IBV_QP_STATE
        | E.IBV_QP_AV
        | E.IBV_QP_PATH_MTU
        | E.IBV_QP_DEST_QPN
        | E.IBV_QP_RQ_PSN
        | E.IBV_QP_MAX_DEST_RD_ATOMIC
        | E.IBV_QP_MIN_RNR_TIMER,
    )

    a = QPAttr()
    a.qp_state = E.IBV_QPS_RTS
    a.timeout = 14  # 4.096us * 2^14 = 67 ms per try
    a.retry_cnt = 7
    a.rnr_retry = 7  # 7 = retry forever on RNR NAK
    a.sq_psn = local.psn
    a.max_rd_atomic = 1
    qp.modify(
        a,
        E.IBV_QP_STATE
        | E.IBV_QP_TIMEOUT
        | E.IBV_QP_RETRY_CNT
        | E.IBV_QP_RNR_RETRY
        | E.IBV_QP_SQ_PSN
        | E.IBV_QP_MAX_QP_RD_ATOMIC,
    )


def reset(qp: QP) -> None:
    a = QPAttr()
    a.qp_state = E.IBV_QPS_RESET
    qp.modify(a, E.IBV_QP_STATE)


def poll(cq: CQ, n: int, timeout: float = 30.0) -> list[Any]:
    """Poll until n completions arrived (spin, then back off with short sleeps)."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    idle = 0
    while len(out) < n:
        got, wcs = cq.poll(n - len(out))
        if got:
            out.extend(wcs)
            idle = 0
            continue
        idle += 1
        if idle > 200:
            time.sleep(0.0002)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(out)}/{n} completions after {timeout}s")
    return out


def drain(cq: CQ, settle: float = 0.5) -> list[Any]:
    out: list[Any] = []
    end = time.monotonic() + settle
    while time.monotonic() < end:
        got, wcs = cq.poll(16)
        out.extend(wcs)
        if not got:
            time.sleep(0.01)
    return out


def post_recv(side: Side, wr_id: int) -> None:
    sge = SGE(side.scratch.buf, 64, side.scratch.lkey)
    side.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))


def build_chain(
    src: Side,
    dst: dict[str, Any],
    size: int,
    chunk: int,
    imm: int,
    rkey: int | None = None,
    remote_off: int = 0,
) -> list[SendWR]:
    """RDMA WRITE chunks src[0:size] -> dst[remote_off:], last WR = WRITE_WITH_IMM, signaled.

    Keep the returned list alive until post_send() returned: SendWR.next_wr stores a raw
    pointer to the next WR's C struct and does not hold a Python reference to it.
    """
    wrs: list[SendWR] = []
    nchunks = (size + chunk - 1) // chunk
    for i in range(nchunks):
        off = i * chunk
        ln = min(chunk, size - off)
        last = i == nchunks - 1
        sge = SGE(src.addr + off, ln, src.mr.lkey)
        wr = SendWR(
            wr_id=1000 + i,
            opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM if last else E.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[sge],
            send_flags=E.IBV_SEND_SIGNALED if last else 0,
            # imm_data goes into a __be32 field untouched: send htonl(x), read ntohl(wc.imm_data)
            imm_data=socket.htonl(imm) if last else 0,
        )
        wr.set_wr_rdma(dst["rkey"] if rkey is None else rkey, dst["addr"] + remote_off + off)
        if wrs:
            wrs[-1].next_wr = wr
        wrs.append(wr)
    return wrs


# ----------------------------------------------------------------------------------------------
# Completion-channel fd. pyverbs >= 57: CompChannel.fd. pyverbs 44 has no accessor: the channel
# is the one new "anon_inode:[infinibandevent]" fd that appeared while creating it.
# ----------------------------------------------------------------------------------------------
def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
        except OSError:
            pass
    return fds


def make_channel(ctx: Context) -> tuple[CompChannel, int]:
    before = _event_fds()
    cc = CompChannel(ctx)
    fd = getattr(cc, "fd", None)
    if fd is None:
        new = _event_fds() - before
        if len(new) != 1:
            raise RuntimeError(f"cannot identify the completion channel fd: {new}")
        fd = new.pop()
    return cc, fd


# ----------------------------------------------------------------------------------------------
def transfer(
    a: Side, b: Side, size: int, chunk: int, imm: int, label: str, wait_b: Any = None
) -> float:
    """One full chained write A->B; returns the elapsed seconds (post to both completions)."""
    post_recv(b, 7)
    wrs = build_chain(a, b.info(), size, chunk, imm)
    t0 = time.perf_counter()
    a.qp.post_send(wrs[0])
    (wa,) = poll(a.cq, 1)
    if wait_b is None:
        (wb,) = poll(b.cq, 1)
    else:
        (wb,) = wait_b()
    dt = time.perf_counter() - t0
    del wrs
    check(
        wa.status == E.IBV_WC_SUCCESS
        and wa.opcode == E.IBV_WC_RDMA_WRITE
        and wa.wr_id == 1000 + (size + chunk - 1) // chunk - 1,
        f"{label}: sender WC {wc_str(wa)}",
    )
    check(
        wb.status == E.IBV_WC_SUCCESS
        and wb.opcode == E.IBV_WC_RECV_RDMA_WITH_IMM
        and bool(wb.wc_flags & E.IBV_WC_WITH_IMM),
        f"{label}: target WC {wc_str(wb)}",
    )
    got = socket.ntohl(wb.imm_data)
    check(
        got == imm,
        f"{label}: imm ntohl(wc.imm_data)=0x{got:08x} expected 0x{imm:08x} "
        f"(raw wc.imm_data=0x{wb.imm_data:08x})",
    )
    last_len = size - ((size + chunk - 1) // chunk - 1) * chunk
    check(
        wb.byte_len == last_len,
        f"{label}: target byte_len={wb.byte_len} = length of the WITH_IMM WR ({last_len})",
    )
    t1 = time.perf_counter()
    same = a.mem[:size] == b.mem[:size]
    check(
        same, f"{label}: {size} bytes identical bitwise (compare {time.perf_counter() - t1:.3f}s)"
    )
    say(
        f"  {label}: {size / 2**20:.1f} MiB in {dt * 1e3:.1f} ms = {size / dt / 1e6:.1f} MB/s "
        f"({len(range(0, size, chunk))} WRs of {chunk // 1024} KiB)"
    )
    return dt


def fill(a: Side, b: Side, size: int) -> None:
    a.mem[:size] = os.urandom(size)
    b.mem[:size] = bytes(size)


def setup(args: argparse.Namespace, channel_b: bool = False) -> tuple[Side, Side, Any]:
    ctx_a = Context(name=args.dev_a)
    pd_a = PD(ctx_a)
    if args.dev_b == args.dev_a:
        ctx_b, pd_b = ctx_a, pd_a
    else:
        ctx_b = Context(name=args.dev_b)
        pd_b = PD(ctx_b)
    cc = fd = None
    if channel_b:
        cc, fd = make_channel(ctx_b)
    depth = max(64, args.size // args.chunk + 8)
    a = Side("A", ctx_a, pd_a, args.gid_index, args.size, depth)
    b = Side("B", ctx_b, pd_b, args.gid_index, args.size, depth, channel=cc)
    return a, b, (ctx_a, pd_a, ctx_b, pd_b, cc, fd)


def close_all(a: Side, b: Side, extra: Any) -> None:
    ctx_a, pd_a, ctx_b, pd_b, cc, _fd = extra
    a.close()
    b.close()
    if cc is not None:
        cc.close()
    for obj in (pd_b, ctx_b) if ctx_b is not ctx_a else ():
        obj.close()
    pd_a.close()
    ctx_a.close()


def connect_pair(a: Side, b: Side) -> int:
    mtu = min(a.active_mtu, b.active_mtu)
    connect(a, b.info(), mtu)
    connect(b, a.info(), mtu)
    return mtu


# ----------------------------------------------------------------------------------------------
def gil_child(args: argparse.Namespace) -> int:
    """Run in a child: does a thread blocked in CompChannel.get_cq_event() let others run?"""
    a, b, extra = setup(args, channel_b=True)
    cc = extra[4]
    connect_pair(a, b)
    fill(a, b, args.size)
    b.cq.req_notify()
    post_recv(b, 7)
    got = []

    def waiter() -> None:
        cc.get_cq_event(b.cq)  # blocking read() on the channel fd, inside the GIL
        b.cq.ack_events(1)
        got.extend(poll(b.cq, 1))

    # faulthandler's watchdog is a C thread: it can dump every thread's stack without the GIL.
    faulthandler.dump_traceback_later(6, exit=True)
    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    say("child: waiter thread started; main thread sleeps 0.2 s")
    time.sleep(0.2)  # needs the GIL back to return
    say("child: main thread ran while the waiter thread was blocked in get_cq_event")
    wrs = build_chain(a, b.info(), args.size, args.chunk, 0xC0FFEE)
    a.qp.post_send(wrs[0])
    poll(a.cq, 1)
    t.join(30)
    faulthandler.cancel_dump_traceback_later()
    ok = bool(got) and got[0].status == E.IBV_WC_SUCCESS
    say(f"child: waiter thread got the event: {ok}")
    close_all(a, b, extra)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev-a", default=None, help="device of the writer (default: first)")
    ap.add_argument("--dev-b", default=None, help="device of the target (default: dev-a)")
    ap.add_argument("--gid-index", type=int, default=None, help="force a GID index")
    ap.add_argument("--size", type=int, default=8 << 20, help="bytes per transfer (8 MiB)")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="bytes per WR (1 MiB)")
    ap.add_argument("--iters", type=int, default=3, help="timed polled transfers")
    ap.add_argument("--skip-gil-test", action="store_true")
    ap.add_argument("--gil-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    import pyverbs

    say(
        f"python {sys.version.split()[0]} ({sys.executable}); pyverbs from "
        f"{os.path.dirname(pyverbs.__file__)}; enums: {len(vars(E))} names"
    )
    devs = list_devices()
    if not devs:
        say(
            "SKIP: no RDMA device (inside the VM: modprobe rdma_rxe; "
            "rdma link add rxe0 type rxe netdev lo)"
        )
        return 77
    args.dev_a = args.dev_a or devs[0]
    args.dev_b = args.dev_b or args.dev_a
    if args.gil_child:
        return gil_child(args)

    say(f"devices: {devs}")
    for name in sorted({args.dev_a, args.dev_b}):
        with Context(name=name) as ctx:
            p = ctx.query_port(PORT)
            dattr = ctx.query_device()
            idx, gid, kind = pick_gid(ctx, PORT, args.gid_index)
            say(
                f"{name}: port {PORT} state={p.state} (ACTIVE={E.IBV_PORT_ACTIVE}) "
                f"active_mtu={MTU_BYTES.get(p.active_mtu, p.active_mtu)} "
                f"max_mtu={MTU_BYTES.get(p.max_mtu, p.max_mtu)} link_layer={p.link_layer} "
                f"(ETHERNET={E.IBV_LINK_LAYER_ETHERNET}) max_msg_sz={p.max_msg_sz} "
                f"gid_tbl_len={p.gid_tbl_len}; max_qp_wr={dattr.max_qp_wr} "
                f"max_sge={dattr.max_sge} max_cqe={dattr.max_cqe} "
                f"max_mr_size=0x{dattr.max_mr_size:x}"
            )
            say(f"{name}: using gid[{idx}]={gid} ({kind})")
            check(p.state == E.IBV_PORT_ACTIVE, f"{name} port ACTIVE")

    # ---- 1. polled transfers -------------------------------------------------------------
    say(f"== polled: {args.dev_a} -> {args.dev_b}, {args.size} bytes, {args.chunk}-byte WRs")
    t0 = time.perf_counter()
    a, b, extra = setup(args)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    mtu = connect_pair(a, b)
    t_conn = time.perf_counter() - t0
    say(
        f"  setup (ctx, pd, 2 MRs, cqs, qps) {t_setup * 1e3:.1f} ms (MR reg of "
        f"{args.size >> 20} MiB: {a.reg_s * 1e3:.1f} ms); connect both QPs {t_conn * 1e3:.1f} ms; "
        f"path_mtu={MTU_BYTES[mtu]}; A qpn={a.qp.qp_num} B qpn={b.qp.qp_num} "
        f"states {qp_state(a.qp)}/{qp_state(b.qp)}"
    )
    times = []
    for it in range(args.iters):
        fill(a, b, args.size)
        times.append(transfer(a, b, args.size, args.chunk, 0x12345678 + it, f"iter {it}"))
    if times:
        say(f"  best {args.size / min(times) / 1e6:.1f} MB/s over {len(times)} iters")

    # ---- 3. error completions + recovery -------------------------------------------------
    say("== error completions")
    for label, kw in (
        ("wrong rkey", {"rkey_xor": 0x5A5A00}),
        ("out-of-bounds remote address", {"remote_off": args.size}),
    ):
        post_recv(b, 8)
        wrs = build_chain(
            a,
            b.info(),
            4096,
            4096,
            0xBAD,
            rkey=(b.mr.rkey ^ kw["rkey_xor"]) if "rkey_xor" in kw else None,
            remote_off=kw.get("remote_off", 0),
        )
        a.qp.post_send(wrs[0])
        (wa,) = poll(a.cq, 1)
        time.sleep(0.2)
        wbs = drain(b.cq)
        sa, sb = qp_state(a.qp), qp_state(b.qp)
        check(wa.status == E.IBV_WC_REM_ACCESS_ERR, f"{label}: sender WC {wc_str(wa)}")
        say(
            f"  {label}: QP states after: A={sa} (cached qp.qp_state="
            f"{QPS_NAMES.get(a.qp.qp_state)}) B={sb}; target CQ: "
            + ("; ".join(wc_str(w) for w in wbs) or "nothing")
        )
        check(sa == "ERR", f"{label}: sender QP is in ERR")
        # Recovery: both ends to RESET (flushes their queues), then reconnect with fresh PSNs.
        a.cq.poll(64)
        t0 = time.perf_counter()
        for side in (a, b):
            reset(side.qp)
            side.psn = random.getrandbits(24)
        drain(b.cq, 0.05)
        connect_pair(a, b)
        dt = time.perf_counter() - t0
        say(
            f"  {label}: RESET->INIT->RTR->RTS both QPs in {dt * 1e3:.1f} ms"
            f" -> {qp_state(a.qp)}/{qp_state(b.qp)}"
        )
        fill(a, b, args.size)
        transfer(a, b, args.size, args.chunk, 0x600D, f"after {label}")
    close_all(a, b, extra)

    # ---- 2. completion channel -----------------------------------------------------------
    say("== completion channel (select on the channel fd, then get_cq_event)")
    a, b, extra = setup(args, channel_b=True)
    cc, fd = extra[4], extra[5]
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    say(
        f"  channel fd={fd} ({'CompChannel.fd' if hasattr(cc, 'fd') else '/proc/self/fd scan'}"
        f", {os.readlink(f'/proc/self/fd/{fd}')})"
    )
    connect_pair(a, b)
    try:
        cc.get_cq_event(b.cq)
        check(False, "non-blocking get_cq_event with no event should raise")
    except PyverbsError as exc:
        check(
            getattr(exc, "error_code", None) == errno.EAGAIN,
            f"non-blocking get_cq_event with no event raises ({exc})",
        )
    n_events = 0

    def wait_event() -> list[Any]:
        """The CQ was armed (req_notify) before posting: wait for the event on the fd first."""
        nonlocal n_events
        r, _, _ = select.select([fd], [], [], 30)
        if not r:
            raise TimeoutError("no completion event in 30 s")
        cc.get_cq_event(b.cq)  # non-blocking now: an event is queued
        b.cq.ack_events(1)  # ack every event, or CQ.close() (ibv_destroy_cq) blocks
        n_events += 1
        b.cq.req_notify()  # re-arm BEFORE polling: a CQE landing after the poll re-fires
        return poll(b.cq, 1)

    b.cq.req_notify()
    for it in range(3):
        fill(a, b, args.size)
        transfer(
            a, b, args.size, args.chunk, 0xE0E0E000 + it, f"event iter {it}", wait_b=wait_event
        )
    r, _, _ = select.select([fd], [], [], 0)
    check(not r, "no stray event left on the channel fd")
    check(n_events == 3, f"completion events received: {n_events} (one per transfer)")
    close_all(a, b, extra)

    if not args.skip_gil_test:
        say("== thread blocking in CompChannel.get_cq_event (child process, 20 s watchdog)")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--gil-child",
            "--size",
            str(1 << 20),
            "--chunk",
            str(1 << 18),
            "--dev-a",
            args.dev_a,
            "--dev-b",
            args.dev_b,
        ]
        if args.gid_index is not None:
            cmd += ["--gid-index", str(args.gid_index)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            out, err, rc = res.stdout, res.stderr, res.returncode
        except subprocess.TimeoutExpired as exc:
            out = (
                (exc.stdout or b"").decode(errors="replace")
                if isinstance(exc.stdout, bytes)
                else (exc.stdout or "")
            )
            err, rc = "", "killed after 20 s"
        dt = time.perf_counter() - t0
        for line in out.strip().splitlines()[1:]:
            say(f"  {line}")
        if "main thread ran" in out:
            say(
                f"  child rc={rc} in {dt:.1f}s: a thread blocked in get_cq_event let the main "
                "thread run (GIL released)"
            )
        else:
            say(
                f"  child rc={rc} in {dt:.1f}s: the main thread never woke up from a 0.2 s sleep "
                "while another thread sat in CompChannel.get_cq_event(): pyverbs calls "
                "ibv_get_cq_event() WITH THE GIL HELD, the whole interpreter blocks until an "
                "event arrives. Use the fd + select/add_reader pattern instead."
            )
            stacks = [
                ln.strip()
                for ln in err.splitlines()
                if "File" in ln or ln.startswith(("Thread", "Current thread"))
            ]
            if stacks:
                say("  faulthandler dump of the hung child: " + " | ".join(stacks[:8]))

    say("RESULT: " + ("PASS" if not FAILS else f"FAIL ({len(FAILS)}): " + "; ".join(FAILS)))
    return 0 if not FAILS else 1


if __name__ == "__main__":
    sys.exit(main())
