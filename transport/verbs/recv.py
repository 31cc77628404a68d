"""The receive path (this node is the destination): incoming RC queue pairs, brought up
and rebuilt at a writer's request, each keeping `recv_depth` receives posted for the
WRITE_WITH_IMMs, and the immediates handed to the daemon on their RECV_RDMA_WITH_IMM
completion, which comes only after the bytes are visible.
"""

from __future__ import annotations

import socket
from typing import Any

import structlog

from weightwire.protocol.errors import ErrorCode, PeerLostError, TransferError
from weightwire.transport.base import ImmHandler

from . import wire
from .runtime import Runtime
from .state import BROKEN, DEAD, ID_BITS, READY, InLink, InQp, new_psn

log = structlog.get_logger("weightwire.transport.verbs")

MAX_INCOMING_QPS_PER_NODE = 1024


class Receiver:
    def __init__(self, rt: Runtime, recv_depth: int) -> None:
        self.rt = rt
        self.recv_depth = recv_depth
        self.on_imm: ImmHandler | None = None
        self._inlinks: dict[tuple[str, int], InLink] = {}

    async def accept_connect(self, node: str, req: wire.Connect) -> wire.Reply:
        rt = self.rt
        dev = rt.devs.get(req.dst_device)
        if dev is None:
            raise TransferError(
                f"{rt.node} has no RDMA device {req.dst_device} (has {', '.join(rt.order)})",
                code=ErrorCode.INVALID,
            )
        if not req.qps or len(req.qps) > 64:
            raise TransferError("a link has 1 to 64 queue pairs", code=ErrorCode.INVALID)
        mine = sum(len(il.qps) for (n, _), il in self._inlinks.items() if n == node)
        if mine + len(req.qps) > MAX_INCOMING_QPS_PER_NODE:
            raise TransferError(f"{node} has too many queue pairs here", code=ErrorCode.INVALID)
        self.drop(node, req.link)
        inl = InLink(src=req.src)
        depth = min(self.recv_depth, dev.info.max_qp_wr)

        def build() -> list[InQp]:
            made: list[InQp] = []
            try:
                for info in req.qps:
                    qp = dev.new_qp(1, depth)
                    sge = rt.api.SGE(dev.scratch.buf, 64, dev.scratch.lkey)
                    recv = rt.api.RecvWR(wr_id=0, num_sge=1, sg=[sge])
                    sge.close()  # RecvWR copied it
                    r = InQp(node, dev, qp, int(qp.qp_num), new_psn(), recv, depth)
                    made.append(r)
                    self._bring_up(r, inl.src, info)
            except BaseException:
                for r in made:
                    dev.discard_qp(r.qp, 1, depth)
                raise
            return made

        inl.qps = await rt.thread(build)
        if rt.closed:
            for r in inl.qps:
                rt.forget_qp(dev, r.qpn, [r.qp, r.recv], depth + 1)
            raise PeerLostError("closing")
        self._inlinks[(node, req.link)] = inl
        for r in inl.qps:
            rt.qps[(dev.name, r.qpn)] = r
        self._count()
        log.debug("incoming link up", peer=node, device=dev.name, qps=len(inl.qps))
        return wire.Accepted(
            path=dev.path(),
            qps=tuple(wire.QpInfo(r.qpn, r.psn) for r in inl.qps),
            recv_depth=depth,
        )

    def _bring_up(self, r: InQp, src: wire.Path, peer_qp: wire.QpInfo) -> None:
        """INIT, receives posted, RTR (towards the writer's QP), RTS. Worker thread."""
        r.dev.to_init(r.qp)
        for i in range(r.depth):
            r.recv.wr_id = (r.gen << ID_BITS) | i
            r.qp.post_recv(r.recv)
        r.dev.to_rtr(r.qp, src, peer_qp.qpn, peer_qp.psn)
        r.dev.to_rts(r.qp, r.psn)

    async def accept_reset(self, node: str, req: wire.Reset) -> wire.Reply:
        inl = self._inlinks.get((node, req.link))
        if inl is None or not 0 <= req.index < len(inl.qps):
            raise PeerLostError(f"{self.rt.node} has no such link from {node} (it was dropped)")
        r = inl.qps[req.index]
        r.state = BROKEN
        r.gen += 1
        r.psn = new_psn()

        def rebuild() -> None:
            r.dev.to_reset(r.qp)
            self._bring_up(r, inl.src, req.qp)

        await self.rt.thread(rebuild)
        r.state = READY
        return wire.Accepted(
            path=r.dev.path(), qps=(wire.QpInfo(r.qpn, r.psn),), recv_depth=r.depth
        )

    def drop(self, node: str, link: int) -> None:
        """Destroy one incoming link's queue pairs (the writer closed it, or reconnects)."""
        inl = self._inlinks.pop((node, link), None)
        if inl is None:
            return
        for r in inl.qps:
            r.state = DEAD
            self.rt.forget_qp(r.dev, r.qpn, [r.qp, r.recv], r.depth + 1)
        self._count()

    async def fence_node(self, node: str) -> list[int]:
        """Move every incoming queue pair of `node` to the error state (its writes stop
        landing once this returns), then drop them. Returns the links they made up."""
        keys = [k for k in self._inlinks if k[0] == node]
        links = [self._inlinks.pop(k) for k in keys]
        qps = [r for inl in links for r in inl.qps]
        for r in qps:
            r.state = DEAD

        def stop() -> None:
            for r in qps:
                try:
                    r.dev.to_error(r.qp)
                except self.rt.api.Error as exc:
                    log.warning("fence: queue pair not moved to error", peer=node, error=str(exc))

        if qps:
            await self.rt.thread(stop)
        for r in qps:
            self.rt.forget_qp(r.dev, r.qpn, [r.qp, r.recv], r.depth + 1)
        self._count()
        return [link for _, link in keys]

    def drop_node(self, node: str) -> None:
        for key in [k for k in self._inlinks if k[0] == node]:
            self.drop(*key)

    def close(self) -> None:
        for key in list(self._inlinks):
            self.drop(key[0], key[1])

    def _count(self) -> None:
        self.rt.stats["incoming_qps"] = sum(len(x.qps) for x in self._inlinks.values())

    def recv_done(self, r: InQp, wc: Any) -> None:
        """A receive completed: repost it and hand its immediate to the daemon."""
        if int(wc.wr_id) >> ID_BITS != r.gen or r.state != READY:
            return
        E = self.rt.E
        if int(wc.status) != E.IBV_WC_SUCCESS:
            r.state = BROKEN  # the writer rebuilds it (Reset); reposting would only flush
            log.info(
                "incoming queue pair failed",
                peer=r.node,
                device=r.dev.name,
                qpn=r.qpn,
                status=self.rt.api.status_text(int(wc.status)),
            )
            return
        try:
            r.qp.post_recv(r.recv)
        except self.rt.api.Error as exc:
            r.state = BROKEN
            log.warning("could not repost a receive", peer=r.node, error=str(exc))
        if int(wc.opcode) == E.IBV_WC_RECV_RDMA_WITH_IMM:
            self.rt.stats["imms_received"] += 1
            if self.on_imm is not None:
                try:
                    self.on_imm(socket.ntohl(int(wc.imm_data)), r.node)
                except Exception:
                    log.exception("immediate handler failed")
