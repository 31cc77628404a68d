"""Descriptor checks. RDMA itself only checks an rkey and its bounds, not which region a
descriptor says it is: the first write to a descriptor asks its owner once whether it is
real (`Check`), and the owner refuses an unknown region, a wrong key or a length beyond
the real region with its own error code, before any byte moves.

Also the tests' fault hook (`FAULT_ENV`), which gets one wrong rkey past the check.
"""

from __future__ import annotations

import asyncio
import os

import structlog

from weightwire.protocol.errors import ErrorCode, RegionError
from weightwire.protocol.regions import RegionDescriptor, VerbsKey
from weightwire.transport.removed import unknown

from . import wire
from .mesh import Mesh
from .regions import Regions
from .runtime import Runtime
from .state import CheckKey, Peer

log = structlog.get_logger("weightwire.transport.verbs")

FAULT_ENV = "WEIGHTWIRE_VERBS_FAULT_FILE"  # tests only: see Checks.fault()


class Checks:
    def __init__(self, rt: Runtime, mesh: Mesh, regions: Regions) -> None:
        self.rt = rt
        self.mesh = mesh
        self.regions = regions
        self.fault_file = os.environ.get(FAULT_ENV, "")

    # --- the writer's side ---------------------------------------------------------

    async def validate(self, peer: Peer, dst: RegionDescriptor, key: VerbsKey) -> None:
        """Ask the destination once per descriptor whether it is real: RDMA itself only
        checks rkey and bounds, not which region a descriptor says it is."""
        ck = (dst.id, key.device, key.addr, key.rkey, dst.length)
        if ck in peer.valid:
            return
        task = peer.checking.get(ck)
        if task is None:
            assert self.rt.loop is not None
            task = self.rt.loop.create_task(self._check_remote(peer, ck))
            peer.checking[ck] = task
        await asyncio.shield(task)

    async def _check_remote(self, peer: Peer, ck: CheckKey) -> None:
        try:
            region, device, addr, rkey, length = ck
            await self.mesh.ask(
                peer.node,
                wire.Check(region=region, device=device, addr=addr, rkey=rkey, length=length),
            )
            peer.valid.add(ck)
        finally:
            peer.checking.pop(ck, None)

    # --- the owner's side ------------------------------------------------------------

    def answer(self, req: wire.Check) -> wire.Reply:
        self.rt.stats["checks"] += 1
        with self.rt.lock:
            reg = self.regions.get(req.region)
            if reg is None:  # peer_lost when its rank left (removed): retryable
                raise unknown(req.region, self.regions.removed, " here")
        key = reg.keys.get(req.device)
        if key is None or key.addr != req.addr or key.rkey != req.rkey:
            raise RegionError(f"wrong key for region {req.region}", code=ErrorCode.UNAUTHORIZED)
        if req.length > reg.region.length:
            raise RegionError(
                f"region {req.region} has {reg.region.length} bytes, not {req.length}",
                code=ErrorCode.OUT_OF_BOUNDS,
            )
        return wire.Checked()

    # --- tests only ------------------------------------------------------------------

    def fault(self, rkey: int) -> int:
        """Tests only (WEIGHTWIRE_VERBS_FAULT_FILE): when that file exists and says `rkey`,
        remove it and give this one write a wrong rkey, past the descriptor check, so the
        NIC refuses it with an error completion."""
        if not self.fault_file:
            return rkey
        try:
            with open(self.fault_file) as f:
                what = f.read().strip()
            os.unlink(self.fault_file)
        except OSError:
            return rkey
        if what == "rkey":
            log.warning("fault injected: a write with a wrong rkey", file=self.fault_file)
            return rkey ^ 0x5A5A00
        return rkey
