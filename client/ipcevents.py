"""The daemon's CUDA IPC events (`BucketsIssued`) a trainer rank's packing stream waits on
before reusing a staging slot: each handle opened once, forgotten when the daemon restarts."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class IpcEvents:
    def __init__(self) -> None:
        self._ipc_events: dict[bytes, torch.cuda.Event] = {}  # opened once per handle

    def wait(self, device: torch.device, events: Iterable[bytes]) -> bool:
        """The current stream on `device` waits on each event; False where they cannot be
        opened here (the caller waits for landings instead)."""
        try:
            stream = torch.cuda.current_stream(device)
            for handle in events:
                ev = self._ipc_events.get(handle)
                if ev is None:
                    ev = torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]
                    self._ipc_events[handle] = ev
                stream.wait_event(ev)
        except RuntimeError:  # the events cannot be opened here: wait for landings instead
            return False
        return True

    def clear(self) -> None:
        """The daemon restarted: the new daemon's events are others."""
        self._ipc_events.clear()
