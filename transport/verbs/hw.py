"""One opened RDMA device: context, protection domain, completion queue and channel, and
the verbs calls on queue pairs and memory regions. No transport logic lives here.

Calls that enter the kernel and may take a while (creating and modifying queue pairs,
registering memory) are made by the transport on worker threads; posting and polling are
non-blocking and run on the event loop. pyverbs never releases the GIL inside a call, so a
long registration still holds the interpreter for its duration (see the README).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import threading
from typing import Any

from weightwire.memory.hostmem import page_span
from weightwire.protocol.errors import ErrorCode, TransferError

from .devices import DeviceInfo
from .ibv import Api
from .wire import Path

_channel_lock = threading.Lock()

# RC attributes (as TransferEngine and the probe): 4.096 us * 2^14 = 67 ms per try, 7 tries;
# rnr_retry 7 = retry forever while the responder has no receive posted.
ACK_TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12


MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc: Any = None


def populate(address: int, length: int) -> bool:
    """Fault the pages of host memory in before ibv_reg_mr pins them. pyverbs holds the GIL
    for the whole registration, and faulting fresh pages is most of its time (512 MiB of
    untouched shared memory: 4.2 s, against 28 ms once populated, in the VM); this
    madvise goes through ctypes, which releases the GIL. Contents are kept."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start, span = page_span(address, length)
    return bool(_libc.madvise(start, span, MADV_POPULATE_WRITE) == 0)


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
    return fds


def make_channel(api: Api, ctx: Any) -> tuple[Any, int | None]:
    """A completion channel and its fd, non-blocking. pyverbs >= 57 has `CompChannel.fd`;
    44 has no accessor: the fd is the one new `anon_inode:[infinibandevent]` that appeared
    while creating it (creation is serialized so the scan cannot see another's)."""
    with _channel_lock:
        before = _event_fds()
        cc = api.CompChannel(ctx)
        fd = getattr(cc, "fd", None)
        if not isinstance(fd, int):
            new = _event_fds() - before
            fd = new.pop() if len(new) == 1 else None
    if fd is not None:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    return cc, fd


class OpenDevice:
    """A device opened by one transport: one PD, one CQ (grown as queue pairs are added)."""

    def __init__(self, api: Api, info: DeviceInfo, *, channel: bool, cq_size: int = 4096) -> None:
        self.api = api
        self.info = info
        self.name = info.name
        self.port = info.port
        E = api.E
        self.ctx = api.Context(name=info.name)
        try:
            self.pd = api.PD(self.ctx)
            self.channel: Any = None
            self.fd: int | None = None
            if channel:
                self.channel, self.fd = make_channel(api, self.ctx)
                if self.fd is None:  # no way to wait on it: the transport polls instead
                    self.channel.close()
                    self.channel = None
            self.cq_size = max(64, min(info.max_cqe, cq_size))
            self.cq = api.CQ(self.ctx, self.cq_size, None, self.channel, 0)
            self.cq_reserved = 0
            # WRITE_WITH_IMM consumes a receive but writes nothing into it; pyverbs wants
            # one real SGE, so every receive points at this.
            self.scratch = api.MR(self.pd, 64, E.IBV_ACCESS_LOCAL_WRITE)
        except BaseException:
            self.ctx.close()
            raise
        self._lock = threading.Lock()

    # --- completion queue capacity -------------------------------------------

    def reserve_cq(self, entries: int) -> None:
        """Every queue pair's WRs can each produce a completion (on error, all of them):
        the CQ must hold them all, or it overflows and every queue pair on it fails."""
        with self._lock:
            need = self.cq_reserved + entries
            if need > self.cq_size:
                size = min(self.info.max_cqe, max(need, 2 * self.cq_size))
                if need > size:
                    raise TransferError(
                        f"{self.name}: the completion queue cannot hold {need} entries (device "
                        f"maximum {self.info.max_cqe}); lower verbs_qps_per_peer, "
                        "verbs_send_depth or verbs_recv_depth",
                        code=ErrorCode.INVALID,
                    )
                self.cq.resize(size)
                self.cq_size = size
            self.cq_reserved = need

    def release_cq(self, entries: int) -> None:
        with self._lock:
            self.cq_reserved = max(0, self.cq_reserved - entries)

    # --- memory ----------------------------------------------------------------

    def access(self, relaxed: bool) -> int:
        E = self.api.E
        flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        if relaxed and "IBV_ACCESS_RELAXED_ORDERING" in E:
            flags |= E.IBV_ACCESS_RELAXED_ORDERING  # optional: ignored where unsupported
        return flags

    def register(self, address: int, length: int, relaxed: bool) -> Any:
        return self.api.MR(self.pd, length, self.access(relaxed), address=address)

    def register_dmabuf(self, fd: int, offset: int, length: int, relaxed: bool) -> Any:
        """GPU memory through a dma-buf; remote and local addresses are then dma-buf
        offsets (iova = offset), not virtual addresses."""
        if self.api.DmaBufMR is None:
            raise TransferError(f"this pyverbs ({self.api.version}) has no DmaBufMR")
        return self.api.DmaBufMR(self.pd, length, self.access(relaxed), dmabuf=fd, offset=offset)

    # --- queue pairs -----------------------------------------------------------

    def new_qp(self, send_depth: int, recv_depth: int) -> Any:
        """A queue pair with room for all its completions reserved on the CQ; when it goes,
        `release_cq(send_depth + recv_depth)` gives that room back."""
        self.reserve_cq(send_depth + recv_depth)
        try:
            return self.create_qp(send_depth, recv_depth)
        except BaseException:
            self.release_cq(send_depth + recv_depth)
            raise

    def discard_qp(self, qp: Any, send_depth: int, recv_depth: int) -> None:
        """Undo `new_qp` for a queue pair that never came up: destroy it, give back its room."""
        with contextlib.suppress(Exception):
            qp.close()
        self.release_cq(send_depth + recv_depth)

    def create_qp(self, send_depth: int, recv_depth: int) -> Any:
        api = self.api
        cap = api.QPCap(
            max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1
        )
        init = api.QPInitAttr(
            qp_type=api.E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0
        )
        return api.QP(self.pd, init)

    def path(self) -> Path:
        """What a peer needs to reach this device (GID, MTU), with its largest message."""
        i = self.info
        return Path(
            device=i.name,
            gid=i.gid,
            lid=i.lid,
            mtu=i.active_mtu,
            ethernet=i.ethernet,
            max_msg=i.max_msg_sz,
        )

    def to_init(self, qp: Any) -> None:
        E = self.api.E
        a = self.api.QPAttr()
        a.qp_state = E.IBV_QPS_INIT
        a.pkey_index = 0
        a.port_num = self.port
        a.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        qp.modify(a, E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT | E.IBV_QP_ACCESS_FLAGS)

    def to_rtr(self, qp: Any, remote: Path, qpn: int, psn: int) -> None:
        api, E = self.api, self.api.E
        a = api.QPAttr()
        a.qp_state = E.IBV_QPS_RTR
        a.path_mtu = min(self.info.active_mtu, remote.mtu)
        a.dest_qp_num = qpn
        a.rq_psn = psn
        a.max_dest_rd_atomic = 1
        a.min_rnr_timer = MIN_RNR_TIMER
        gr = api.GlobalRoute(dgid=api.GID(remote.gid), sgid_index=self.info.gid_index, hop_limit=64)
        dlid = 0 if remote.ethernet else remote.lid
        a.ah_attr = api.AHAttr(port_num=self.port, is_global=1, gr=gr, sl=0, dlid=dlid)
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

    def to_rts(self, qp: Any, psn: int) -> None:
        E = self.api.E
        a = self.api.QPAttr()
        a.qp_state = E.IBV_QPS_RTS
        a.timeout = ACK_TIMEOUT
        a.retry_cnt = RETRY_CNT
        a.rnr_retry = RNR_RETRY
        a.sq_psn = psn
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

    def to_error(self, qp: Any) -> None:
        """Stop a queue pair at once: incoming writes to it are dropped from now on."""
        a = self.api.QPAttr()
        a.qp_state = self.api.E.IBV_QPS_ERR
        qp.modify(a, self.api.E.IBV_QP_STATE)

    def to_reset(self, qp: Any) -> None:
        E = self.api.E
        a = self.api.QPAttr()
        a.qp_state = E.IBV_QPS_RESET
        qp.modify(a, E.IBV_QP_STATE)

    # --- teardown ----------------------------------------------------------------

    def close(self) -> None:
        """Closing the context closes every object made from it (QPs, MRs, CQ, PD)."""
        for obj in (self.scratch, self.cq, self.channel, self.pd, self.ctx):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
