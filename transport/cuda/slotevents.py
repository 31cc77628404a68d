"""Interprocess CUDA events fencing a staging ring's slots on the cuda transport's lanes:
one event per (slot, lane), made once and recorded again by each post for that slot, so
that a trainer rank's packing stream waits on the GPU for the copies out of a slot instead
of its thread waiting for their landing."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence

import structlog

from weightwire.memory.cudadrv import CudaError, Driver

from .lanes import Fence

log = structlog.get_logger("weightwire.transport.cuda")

Lane = tuple[int, int]  # (copying device, destination's)


class SlotEvents:
    def __init__(self) -> None:
        self._by_slot: dict[tuple[Hashable, Lane], tuple[int, bytes]] = {}  # (event, handle)
        self._enabled = True  # False once the driver refused one: no fences from then on
        self._by_handle: dict[bytes, int] = {}  # those events, by their IPC handles

    def of(self, handles: Sequence[bytes]) -> list[int] | None:
        """The events behind `handles` (as `fences` reported them); None if one is not
        one of these."""
        events = [self._by_handle.get(h, 0) for h in handles]
        return None if not all(events) else events

    def event(self, drv: Driver, slot: Hashable, key: Lane) -> tuple[int, bytes] | None:
        """The interprocess event fencing `slot` on lane `key` (made once), or None."""
        found = self._by_slot.get((slot, key))
        if found is None and self._enabled:
            try:
                drv.use(key[0])
                found = self._by_slot[slot, key] = drv.ipc_event()
                self._by_handle[found[1]] = found[0]
            except CudaError as exc:
                self._enabled = False
                log.warning("no interprocess cuda events: slots wait for landings", error=str(exc))
        return found

    def fences(
        self,
        drv: Driver,
        slot: Hashable,
        lanes: Sequence[Lane],
        on_issued: Callable[[tuple[bytes, ...]], None],
    ) -> dict[Lane, Fence]:
        """A fence for each of `lanes`, its event recorded after the lane's last copy of a
        post; once every lane has issued, `on_issued` gets their events' IPC handles. Empty
        (nothing to report) when an event cannot be made."""
        handles: list[bytes] = []
        left = [len(lanes)]

        def issued(handle: bytes) -> None:
            handles.append(handle)
            left[0] -= 1
            if not left[0]:
                try:
                    on_issued(tuple(handles))
                except Exception as exc:  # called from a lane's issuing: never break it
                    log.error("issued copies not reported", error=repr(exc))

        out: dict[Lane, Fence] = {}
        for key in lanes:
            found = self.event(drv, slot, key)
            if found is None:
                return {}
            event, handle = found
            out[key] = Fence(event, functools.partial(issued, handle))
        return out

    def close(self, drv: Driver | None) -> None:
        if drv is not None:
            for event, _ in self._by_slot.values():
                with contextlib.suppress(CudaError):
                    drv.destroy_event(event)
        self._by_slot.clear()
        self._by_handle.clear()
