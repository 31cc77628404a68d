"""The send path: a write (each block of a strided one) cut into work requests of at most
the link's chunk size, posted on one queue pair in chains of `wr_per_post`, with the send
queue's slots counted here.

Only the last WR of a write, and one every half send queue, is signaled. Real NICs free
the slots of unsignaled WRs only when a later signaled WR completes (Soft-RoCE does not
enforce it), so each signaled WR carries the number of slots it frees. The last WR is
WRITE_WITH_IMM when there is an immediate, and only while the peer has a receive posted
for it (`credits`). The write resolves on its last WR's send completion: RC ordering
puts every earlier WR of the queue pair in place before that.

An error completion, a failed post or a stall fails every write on the queue pair with
an error naming the peer, and hands the queue pair over to be rebuilt.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog

from weightwire.protocol.errors import ErrorCode, PeerLostError, RegionError, TransferError

from .hw import OpenDevice
from .ibv import Api
from .runtime import Runtime
from .state import BROKEN, ID_BITS, ID_MASK, READY, Link, Qp, Write

log = structlog.get_logger("weightwire.transport.verbs")


def make_chain(api: Api, dev: OpenDevice, n: int) -> tuple[list[Any], list[Any]]:
    """n SendWRs chained once (wr[i].next = wr[i+1]; the last ends the chain); each
    points at an SGE of its own that is rewritten for every post."""
    E = api.E
    sges, wrs = [], []
    for _ in range(n):
        sge = api.SGE(dev.scratch.buf, 0, dev.scratch.lkey)
        wr = api.SendWR(wr_id=0, opcode=E.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=0)
        wr.sg_list = sge  # the WR now reads this SGE (never close the WR: see README notes)
        sges.append(sge)
        wrs.append(wr)
    for a, b in itertools.pairwise(wrs):
        a.next_wr = b
    return wrs, sges


class Sender:
    def __init__(self, rt: Runtime, on_broken: Callable[[Qp], None]) -> None:
        self.rt = rt
        self.on_broken = on_broken  # called once a failed queue pair is to be rebuilt
        self._ids = itertools.count(1)

    def submit(
        self,
        link: Link,
        *,
        local_addr: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        length: int,
        imm: int | None,
        count: int = 1,
        src_stride: int = 0,
        dst_stride: int = 0,
    ) -> asyncio.Future[None]:
        """Queue a write (every block of it) on the least busy queue pair of the link; the
        future resolves on its last WR's send completion."""
        assert self.rt.loop is not None
        w = Write(
            id=next(self._ids) & ID_MASK,
            future=self.rt.loop.create_future(),
            local_addr=local_addr,
            lkey=lkey,
            remote_addr=remote_addr,
            rkey=rkey,
            length=length,
            imm=None if imm is None else imm & 0xFFFFFFFF,
            wrs_left=count * max(1, -(-length // link.chunk)),
            count=count,
            src_stride=src_stride,
            dst_stride=dst_stride,
        )
        q = link.pick()
        q.queue.append(w)
        self.pump(q)
        return w.future

    def pump(self, q: Qp) -> None:
        """Post as much of the QP's queue as its send queue and the peer's receives allow,
        in chains of at most wr_per_post WRs."""
        E = self.rt.E
        write_op, imm_op, signaled_flag = (
            E.IBV_WR_RDMA_WRITE,
            E.IBV_WR_RDMA_WRITE_WITH_IMM,
            E.IBV_SEND_SIGNALED,
        )
        every = max(1, q.depth // 2)
        chunk = q.link.chunk
        per = len(q.wrs)
        while q.state == READY and q.queue:
            w = q.queue[0]
            k = min(per, w.wrs_left)
            if q.used + k > q.depth:
                break
            ends = k == w.wrs_left
            if ends and w.imm is not None and q.credits <= 0:
                if k == 1:
                    break
                k -= 1
                ends = False
            first = per - k
            entries: list[tuple[int, int, Write | None]] = []
            offset = w.offset
            for j in range(k):
                wr, sge = q.wrs[first + j], q.sges[first + j]
                block, within = divmod(offset, w.length) if w.count > 1 else (0, offset)
                n = min(chunk, w.length - within)
                sge.addr = w.local_addr + block * w.src_stride + within
                sge.length = n
                sge.lkey = w.lkey
                wr.set_wr_rdma(w.rkey, w.remote_addr + block * w.dst_stride + within)
                final = ends and j == k - 1
                wr_id = (q.gen << ID_BITS) | w.id
                wr.wr_id = wr_id
                if final and w.imm is not None:
                    wr.opcode = imm_op
                    wr.imm_data = socket.htonl(w.imm)  # a __be32 field, stored untouched
                else:
                    wr.opcode = write_op
                q.run += 1
                if final or q.run >= every:
                    wr.send_flags = signaled_flag
                    entries.append((wr_id, q.run, w if final else None))
                    q.run = 0
                else:
                    wr.send_flags = 0
                offset += n
            try:
                q.qp.post_send(q.wrs[first])
            except self.rt.api.Error as exc:
                q.run = 0
                self.qp_failed(q, None, w.id, f"post_send failed: {exc}")
                return
            if not q.used:
                q.last_progress = time.monotonic()
            q.used += k
            q.signaled.extend(entries)
            w.offset = offset
            w.wrs_left -= k
            q.inflight[w.id] = w
            if ends:
                q.queue.popleft()
                if w.imm is not None:
                    q.credits -= 1
            st = self.rt.stats
            st["wrs_posted"] += k
            st["posts"] += 1
            if q.used > st["max_sq_used"]:
                st["max_sq_used"] = q.used

    def send_done(self, q: Qp, wc: Any) -> None:
        """A send completion: frees the slots its signaled WR stood for, resolves the write
        it ended, and posts what waited for room."""
        wr_id = int(wc.wr_id)
        if wr_id >> ID_BITS != q.gen or q.state != READY:
            return  # a completion of an earlier generation (flushed by an error)
        status = int(wc.status)
        if status != self.rt.E.IBV_WC_SUCCESS:
            self.rt.stats["error_completions"] += 1
            self.qp_failed(q, status, wr_id & ID_MASK, self.rt.api.status_text(status))
            return
        if not q.signaled:
            log.warning("unexpected send completion", qpn=q.qpn, wr_id=wr_id)
            return
        _, slots, w = q.signaled.popleft()
        q.used -= slots
        q.last_progress = time.monotonic()
        if w is not None:
            q.inflight.pop(w.id, None)
            if w.imm is not None:
                q.credits += 1
            self.rt.stats["bytes_sent"] += w.length * w.count
            self.rt.stats["writes"] += 1
            if not w.future.done():
                w.future.set_result(None)
        self.pump(q)

    def qp_failed(self, q: Qp, status: int | None, culprit: int, reason: str) -> None:
        """Fail every write on the QP, then rebuild the QP pair."""
        if q.state != READY:
            return
        E = self.rt.E
        peer, link = q.link.peer, q.link
        where = f"{link.dev.name} -> {peer}:{link.dst_device} (qp {q.qpn})"
        lost = status is None or status in (
            E.get("IBV_WC_RETRY_EXC_ERR", 12),
            E.get("IBV_WC_RNR_RETRY_EXC_ERR", 13),
        )
        refused = status in (
            E.get("IBV_WC_REM_ACCESS_ERR", 10),
            E.get("IBV_WC_REM_INV_REQ_ERR", 9),
            E.get("IBV_WC_REM_OP_ERR", 11),
        )
        log.warning("write failed on a queue pair", peer=peer, where=where, error=reason)

        def error(w: Write) -> TransferError:
            if lost:
                return PeerLostError(f"{peer} did not answer on {where}: {reason}")
            if w.id == culprit and refused:
                return RegionError(
                    f"{peer} refused the write on {where} ({reason}): wrong rkey, outside "
                    "the region, or the region is gone",
                    code=ErrorCode.UNAUTHORIZED,
                )
            if w.id == culprit:
                return TransferError(f"write to {peer} failed on {where}: {reason}")
            return TransferError(
                f"write to {peer} failed: another write failed on {where} ({reason}) while "
                "this one was in flight"
            )

        q.state = BROKEN
        q.gen += 1
        self.fail_writes(q, error)
        self.on_broken(q)

    def fail_writes(self, q: Qp, error: Callable[[Write], TransferError]) -> None:
        """Fail every write queued or in flight on the QP and forget its accounting."""
        writes = list(q.inflight.values()) + [w for w in q.queue if w.id not in q.inflight]
        q.inflight.clear()
        q.queue.clear()
        q.signaled.clear()
        q.used = q.run = 0
        for w in writes:
            if not w.future.done():
                self.rt.stats["write_errors"] += 1
                w.future.set_exception(error(w))
