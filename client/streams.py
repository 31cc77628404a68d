"""CUDA streams made for one user alone, never taken from torch's stream pool.

`torch.cuda.Stream()` hands out the streams of a pool, round robin (32 per device and
priority in c10): two `Stream()` objects made 32 draws apart are the same CUDA stream. A
stream that is held (a rank's packing stream, waiting on the GPU for slot counters) or
captured (a bucket's CUDA graph) must not be anyone else's: work another thread queues on
a stream that is being captured goes into that capture's graph instead of running (or,
waiting on an event recorded outside the capture, invalidates it: cudaErrorStreamCapture-
Invalidated), and a release written on a stream that is the one waiting for it never runs.
`own_stream` makes a stream of its own with the driver (cuStreamCreate, non-blocking: no
implicit ordering with the legacy default stream, so a capture on it does not forbid other
threads' use of that stream) and wraps it for torch; it lives as long as the process.
"""

from __future__ import annotations

import threading

import torch

from weightwire.memory.cudadrv import driver


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream on `device`, no other object's (see the module)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    drv = driver()
    drv.use(index)  # the primary context, the one torch uses
    handle = drv.stream()
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))  # type: ignore[no-untyped-call]


class OwnStreams:
    """One `own_stream` per device, made on first use, for one user (one thread at a time)."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = own_stream(torch.device("cuda", index))
            return stream
