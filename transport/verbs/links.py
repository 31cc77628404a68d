"""Queue-pair bring-up and rebuild (this node writes). Per peer, a "link" per (local
device, remote device) pair holds `qps_per_peer` RC queue pairs, brought up on first use
through the daemons' mesh (`Connect`: QPN, PSN, GID and MTU both ways). A failed queue pair
is rebuilt (RESET, INIT, RTR, RTS with new PSNs; the peer re-posts its receives on
`Reset`); a link that cannot be rebuilt is dropped, failing its writes. A watchdog fails a
queue pair with work posted and no completion for `stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time

import structlog

from weightwire.protocol.errors import PeerLostError, TransferError, WeightwireError
from weightwire.protocol.regions import TransportEndpoints

from . import wire
from .mesh import Mesh
from .runtime import Runtime
from .send import Sender, make_chain
from .state import DEAD, READY, Link, Peer, Qp, new_psn

log = structlog.get_logger("weightwire.transport.verbs")


class Links:
    def __init__(
        self,
        rt: Runtime,
        mesh: Mesh,
        sender: Sender,
        *,
        chunk_bytes: int,
        wr_per_post: int,
        qps_per_peer: int,
        send_depth: int,
        stall_timeout_s: float,
    ) -> None:
        self.rt = rt
        self.mesh = mesh
        self.sender = sender
        self.chunk_bytes = chunk_bytes
        self.wr_per_post = wr_per_post
        self.qps_per_peer = qps_per_peer
        self.send_depth = send_depth
        self.stall_timeout_s = stall_timeout_s
        self.peers: dict[str, Peer] = {}
        self._link_ids = itertools.count(secrets.randbits(40) << 16)

    # --- peers -------------------------------------------------------------------

    def connect(self, node: str, endpoints: TransportEndpoints) -> None:
        peer = self.peers.get(node)
        if peer is None:
            self.peers[node] = Peer(node, endpoints)
        else:
            peer.endpoints = endpoints

    def disconnect(self, node: str, reason: str) -> None:
        peer = self.peers.pop(node, None)
        if peer is not None:
            self._drop_peer(peer, reason, notify=True)

    def close(self, reason: str) -> None:
        for peer in list(self.peers.values()):
            self._drop_peer(peer, reason, notify=False)
        self.peers.clear()

    def _drop_peer(self, peer: Peer, reason: str, *, notify: bool) -> None:
        for link in list(peer.links.values()):
            self.kill(link, f"{peer.node}: {reason}", notify=notify)
        peer.links.clear()
        peer.valid.clear()  # checks still running end by their own timeout

    def _count(self) -> None:
        self.rt.stats["links"] = sum(len(p.links) for p in self.peers.values())

    # --- bring-up ------------------------------------------------------------------

    async def link(self, peer: Peer, sdev: str, ddev: str) -> Link:
        """The link from local device `sdev` to the peer's `ddev`, brought up on first use."""
        link = peer.links.get((sdev, ddev))
        if link is not None:
            await asyncio.shield(link.up)
            return link
        assert self.rt.loop is not None
        dev = self.rt.devs[sdev]
        link = Link(
            id=next(self._link_ids) & ((1 << 63) - 1),
            peer=peer.node,
            dev=dev,
            dst_device=ddev,
            up=self.rt.loop.create_future(),
        )
        peer.links[(sdev, ddev)] = link
        try:
            await self._bring_up(link)
        except BaseException as exc:
            err = (
                exc
                if isinstance(exc, TransferError)
                else PeerLostError(f"cannot reach {peer.node} over {sdev} -> {ddev}: {exc!r}")
            )
            if not link.up.done():
                link.up.set_exception(err)
                link.up.exception()  # retrieved: other waiters get it from their own await
            self.kill(link, err.message, notify=False)
            raise err from None
        if self.peers.get(peer.node) is not peer:  # disconnected meanwhile
            self.kill(link, f"{peer.node} was disconnected", notify=True)
            raise PeerLostError(f"{peer.node} was disconnected")
        link.up.set_result(None)
        self._count()
        return link

    async def _bring_up(self, link: Link) -> None:
        rt = self.rt
        dev = link.dev
        depth = max(2 * self.wr_per_post, min(self.send_depth, dev.info.max_qp_wr))

        def create() -> list[Qp]:
            made: list[Qp] = []
            try:
                for i in range(self.qps_per_peer):
                    qp = dev.new_qp(depth, 1)
                    wrs, sges = make_chain(rt.api, dev, self.wr_per_post)
                    q = Qp(link, i, qp, int(qp.qp_num), new_psn(), depth, wrs, sges)
                    made.append(q)
                    dev.to_init(qp)
            except BaseException:
                for q in made:
                    dev.discard_qp(q.qp, depth, 1)
                raise
            return made

        link.qps = await rt.thread(create)
        reply = await self.mesh.ask(
            link.peer,
            wire.Connect(
                link=link.id,
                src=dev.path(),
                dst_device=link.dst_device,
                qps=tuple(wire.QpInfo(q.qpn, q.psn) for q in link.qps),
            ),
        )
        if (
            not isinstance(reply, wire.Accepted)
            or reply.path is None
            or len(reply.qps) != len(link.qps)
        ):
            raise TransferError(f"{link.peer} answered a verbs connect with {reply}")
        remote = reply.path
        link.remote = remote
        chunk = min(self.chunk_bytes, dev.info.max_msg_sz or self.chunk_bytes)
        if remote.max_msg:
            chunk = min(chunk, remote.max_msg)
        link.chunk = max(1, chunk)

        def up() -> None:
            for q, theirs in zip(link.qps, reply.qps, strict=True):
                dev.to_rtr(q.qp, remote, theirs.qpn, theirs.psn)
                dev.to_rts(q.qp, q.psn)

        await rt.thread(up)
        if link.dead or rt.closed:
            raise PeerLostError(link.dead or "closing")
        for q in link.qps:
            q.credits = max(1, reply.recv_depth)
            rt.qps[(dev.name, q.qpn)] = q
        log.info(
            "verbs link up",
            peer=link.peer,
            local=dev.name,
            remote=link.dst_device,
            qps=[q.qpn for q in link.qps],
            chunk=link.chunk,
        )

    # --- rebuild and teardown ------------------------------------------------------------

    def rebuild_later(self, q: Qp) -> None:
        """The sender failed this queue pair: rebuild it in the background."""
        self.rt.spawn(self.rebuild(q))

    async def rebuild(self, q: Qp) -> None:
        link = q.link
        try:
            await self.rt.thread(lambda: q.dev.to_reset(q.qp))
            q.psn = new_psn()
            reply = await self.mesh.ask(
                link.peer,
                wire.Reset(link=link.id, index=q.index, qp=wire.QpInfo(q.qpn, q.psn)),
            )
            if not isinstance(reply, wire.Accepted) or len(reply.qps) != 1:
                raise TransferError(f"{link.peer} answered a reset with {reply}")
            theirs = reply.qps[0]
            remote = reply.path or link.remote
            assert remote is not None

            def up() -> None:
                q.dev.to_init(q.qp)
                q.dev.to_rtr(q.qp, remote, theirs.qpn, theirs.psn)
                q.dev.to_rts(q.qp, q.psn)

            await self.rt.thread(up)
        except (WeightwireError, self.rt.api.Error, OSError) as exc:
            if not link.dead:
                log.warning("queue pair not rebuilt: link dropped", peer=link.peer, error=str(exc))
                self.kill(link, f"{link.peer}: rebuilding queue pair failed: {exc}", notify=True)
            return
        if link.dead or q.state == DEAD:
            return
        q.state = READY
        q.credits = max(1, reply.recv_depth)
        q.last_progress = time.monotonic()
        self.rt.stats["qp_rebuilds"] += 1
        log.info("queue pair rebuilt", peer=link.peer, device=q.dev.name, qpn=q.qpn)
        self.sender.pump(q)

    def fenced(self, node: str, ids: tuple[int, ...]) -> None:
        """`node` destroyed its end of these links (a fence): fail and forget them, so that
        the next write brings up new ones instead of waiting for its retries to run out."""
        peer = self.peers.get(node)
        for link in list(peer.links.values()) if peer is not None else []:
            if link.id in ids:
                self.kill(link, f"{node} fenced this node's writes", notify=False)

    def kill(self, link: Link, reason: str, *, notify: bool) -> None:
        """Fail everything on the link, destroy its QPs, forget it (and tell the peer)."""
        if link.dead:
            return
        rt = self.rt
        link.dead = reason
        if not link.up.done():
            link.up.set_exception(PeerLostError(reason))
            link.up.exception()  # retrieved: waiters get it through their own await
        peer = self.peers.get(link.peer)
        if peer is not None and peer.links.get((link.dev.name, link.dst_device)) is link:
            del peer.links[(link.dev.name, link.dst_device)]
        for q in link.qps:
            self.sender.fail_writes(q, lambda w: PeerLostError(reason))
            q.state = DEAD
            rt.forget_qp(link.dev, q.qpn, [q.qp, *q.sges], q.depth + 1)
        self._count()
        if notify and not rt.closed:
            rt.spawn(self._tell_close(link.peer, link.id))

    async def _tell_close(self, node: str, link: int) -> None:
        with contextlib.suppress(WeightwireError):
            await self.mesh.ask(node, wire.Close(link=link))

    async def watchdog(self) -> None:
        """A QP with work posted and no completion for stall_timeout_s is failed."""
        period = max(0.05, min(1.0, self.stall_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                for link in list(peer.links.values()):
                    for q in link.qps:
                        if (
                            q.state == READY
                            and q.used
                            and now - q.last_progress > (self.stall_timeout_s)
                        ):
                            self.sender.qp_failed(
                                q,
                                None,
                                -1,
                                f"no completion for {self.stall_timeout_s:.0f} s",
                            )
