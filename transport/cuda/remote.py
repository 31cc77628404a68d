"""Regions of other daemons of this host that one cuda transport writes into through their
CUDA IPC handles (each allocation opened once, `ipc.py`), and how it lets one go.

A daemon learns another's GPU regions only from its plans: a `RankPlan` names the regions
its rank writes, with the `CudaKey` their owner advertised. The owner removes a region when
its rank leaves (the coordinator then withdraws the job's plan, or plans an elastic job
without it) or releases its memory (the owner advertises the region without its key, and
the job is planned again). Either way the region leaves this daemon's plans, and the daemon
says which regions its installed plans still name (`keep`). The owner cannot see this
process's copies into the memory, nor close its mappings of it; here:

- a write into a region let go is refused `peer_lost` (retryable, `removed.gone`), as the
  owner refuses one into a region it removed; a plan that names it again (with the same
  handle) makes it writable again;
- the copies resolved into it are counted (`inflight.REGIONS`, under a key of this writer's
  and the handle, `Copy.via`): one still queued on a lane when it is let go is refused at
  issue, one issued before fails once it has landed (no immediate);
- once those are done (waiting at most `LET_GO_WAIT_S`, then with an error line), the
  mappings this process made of the allocation (opened, and per copying device) are
  closed, unless a region still named is in the same allocation. A mapping keeps the
  owner's memory allocated (its free frees nothing) and a write through it lands in memory
  nobody owns any more.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

import structlog

from weightwire.protocol.regions import RegionDescriptor
from weightwire.transport.removed import RemovedRegions, gone

from .inflight import REGIONS, Key
from .ipc import IpcMaps

log = structlog.get_logger("weightwire.transport.cuda")

LET_GO_WAIT_S = 10.0  # as the owner's UNMAP_WAIT_S: a rank's memory is not held for ever

Ref = tuple[str, int]  # (node, region id)


class RemoteRegions:
    """One cuda transport's writes into other processes' regions (loop and worker threads)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._open: dict[Ref, tuple[bytes, int]] = {}  # written into: (handle, token)
        self._gone = RemovedRegions()  # (node, id, handle) let go: writes refused
        self._leaving: dict[bytes, list[Key]] = {}  # handles let go, not closed: their keys

    def _via(self, node: str, handle: bytes) -> str:
        return f"{self.node}>{node}:{handle.hex()}"

    def resolve(self, node: str, region_id: int, handle: bytes) -> tuple[int, str]:
        """(token, via) of a write into region `region_id` of `node` through `handle`:
        its copies are counted under (via, region_id). peer_lost if it was let go."""
        ref = (node, region_id)
        via = self._via(node, handle)
        with self._lock:
            if (node, region_id, handle) in self._gone:
                raise gone(region_id)
            found = self._open.get(ref)
            if found is not None and found[0] == handle:
                return found[1], via
        token = REGIONS.register((via, region_id))
        with self._lock:
            old = self._open.get(ref)
            self._open[ref] = (handle, token)
        if old is not None and old[0] != handle:  # named with a new handle before `keep`
            self._leave(ref, old[0])
        return token, via

    def _leave(self, ref: Ref, handle: bytes) -> None:
        key = (self._via(ref[0], handle), ref[1])
        REGIONS.deregister(key)  # queued copies are refused, issued ones fail once landed
        with self._lock:
            self._gone.add((*ref, handle))
            self._leaving.setdefault(handle, []).append(key)

    def keep(self, regions: Iterable[RegionDescriptor]) -> tuple[bool, dict[bytes, list[Key]]]:
        """The regions of other nodes that the installed plans name now (with their keys):
        any written into before and named no more (or with another handle) is let go.
        Whether anything changed, and the handles whose mappings may be closed once their
        keys are drained (`let_go`): let go, and no region named or written is in them."""
        named: dict[Ref, bytes] = {}
        for r in regions:
            if r.keys.cuda is not None and r.node != self.node:
                named[(r.node, r.id)] = r.keys.cuda.ipc_handle
        with self._lock:
            back = [k for k in ((*ref, h) for ref, h in named.items()) if k in self._gone]
            for k in back:
                self._gone.discard(k)
            going = [(ref, h) for ref, (h, _) in self._open.items() if named.get(ref) != h]
            for ref, _ in going:
                del self._open[ref]
        for ref, handle in going:
            self._leave(ref, handle)
        with self._lock:
            used = set(named.values()) | {h for h, _ in self._open.values()}
            closing = {h: keys for h, keys in self._leaving.items() if h not in used}
            for h in closing:
                del self._leaving[h]
        if going:
            log.info(
                "regions of other daemons let go",
                regions=[f"{node}/{rid}" for (node, rid), _ in going],
            )
        return bool(back or going), closing

    def in_use(self, handle: bytes) -> bool:
        """Whether a region written into, or let go and not closed yet, is in `handle`'s
        allocation (a plan named it again since it was let go)."""
        with self._lock:
            return handle in self._leaving or any(h == handle for h, _ in self._open.values())

    @staticmethod
    def drained(keys: Iterable[Key], timeout_s: float) -> bool:
        """Whether no copy under `keys` is in flight, waiting up to `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        return all(REGIONS.drained(k, max(0.0, deadline - time.monotonic())) for k in keys)

    async def let_go(
        self, handle: bytes, keys: list[Key], ipc: IpcMaps, timeout_s: float = LET_GO_WAIT_S
    ) -> None:
        """Close this process's mappings of `handle`'s allocation once the copies counted
        under `keys` are done (at most `timeout_s`): on the loop, where writes resolve,
        unless a plan named a region in it again meanwhile."""
        drained = await asyncio.to_thread(self.drained, keys, timeout_s)
        if self.in_use(handle):
            return
        if not drained:
            log.error(
                "copies into another daemon's region still in flight: its mapping closed "
                "all the same",
                waited_s=timeout_s,
            )
        ipc.forget(handle)

    def close(self) -> None:
        """The transport closed: its registrations leave `REGIONS`."""
        with self._lock:
            opened = list(self._open.items())
            self._open.clear()
        for (node, region_id), (handle, _) in opened:
            REGIONS.deregister((self._via(node, handle), region_id))


__all__ = ["LET_GO_WAIT_S", "RemoteRegions"]
