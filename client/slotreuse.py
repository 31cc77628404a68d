"""When a trainer rank may pack a bucket into a ring slot again, once the bucket packed
there before is done with it: on the GPU (the packing stream waits on the slot's counter,
which the daemon writes), on the daemon's CUDA IPC events (the packing stream waits on the
copies that read the slot), or on this thread (until that bucket has landed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from weightwire.protocol.plan import StagingRing

from .ipcevents import IpcEvents
from .posting import Poster
from .ring import Landed
from .slotwait import SlotWaits
from .versionstart import Begun


class SlotReuse:
    """The rank's side of slot reuse across versions: its GPU counters (`SlotWaits`), the
    daemon's IPC events it opened, and whether it still asks for them."""

    def __init__(self, slots: SlotWaits, events: bool) -> None:
        self.slots = slots
        self.events = events  # ask for slot events (off once they cannot be opened here)
        self._ipc_events = IpcEvents()

    def forget_events(self) -> None:
        """The daemon restarted: the new daemon's events are others."""
        self._ipc_events.clear()

    def wait_events(self, device: torch.device, events: tuple[bytes, ...]) -> bool:
        if self._ipc_events.wait(device, events):
            return True
        self.events = False  # they cannot be opened here: wait for landings instead
        return False


class VersionSlots:
    """One version's waits for ring slots, and how many slots were freed each way."""

    def __init__(
        self,
        reuse: SlotReuse,
        begun: Begun,
        poster: Poster,
        landed: Landed,
        events_on: Callable[[torch.device, StagingRing], bool],
        timeout_s: float,
        what: str,
    ) -> None:
        """`events_on(device, ring)`: whether the copies' events are asked for
        (`BeginVersion.slot_events`), read at each wait."""
        self._reuse, self._poster, self._landed = reuse, poster, landed
        self._counters, self._device, self._ring = begun.counters, begun.device, begun.ring
        self._events_on, self._timeout_s, self._what = events_on, timeout_s, what
        self.by_event = self.by_landing = self.by_counter = 0

    def free(self, bucket: int, reuse: int) -> bool:
        """Wait until `bucket`'s slot, where bucket `reuse` was packed, may be packed again;
        False: the version ended first (its result says why)."""
        poster, landed = self._poster, self._landed
        if self._counters is not None:  # the GPU waits for the slot
            if not poster.await_posted(landed, reuse, self._timeout_s, self._what):
                return False
            self._reuse.slots.wait(self._counters, self._ring.slot[bucket], reuse)
            self.by_counter += 1
            return True
        # wait until the bucket packed in this slot has landed, or its copies are issued
        # (the GPU waits on them)
        poster.flush(reuse)
        freed = self._slot_free(reuse)
        if freed == "ended":
            return False
        self.by_event += freed == "events"
        self.by_landing += freed == "landed"
        return True

    def end(self, landed: bool, buckets: int) -> None:
        """The version is over, with its `buckets` sequence numbers used; one that did not
        land releases its slot counters, so that no GPU wait is left behind."""
        if self._counters is not None and not landed:
            self._reuse.slots.release(self._counters, buckets)
        self._reuse.slots.advance(buckets)

    def _slot_free(self, reuse: int) -> Literal["events", "landed", "ended"]:
        """Wait until bucket `reuse`'s slot may be packed again: its copies issued and the
        packing stream waiting on their events, or (no events) its writes landed; "ended":
        the version ended first."""
        poster, landed, what = self._poster, self._landed, self._what
        issued = self._events_on(self._device, self._ring)
        if not poster.await_landed(landed, reuse, self._timeout_s, what, issued=issued):
            return "ended"
        events = landed.events(reuse) if issued else ()
        if not events:
            return "landed"
        if not self._reuse.wait_events(self._device, events):
            landed.forget_issued()
            ok = poster.await_landed(landed, reuse, self._timeout_s, what)
            return "landed" if ok else "ended"
        return "events"
