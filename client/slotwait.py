"""A trainer rank's side of GPU ring-slot counters (`BeginVersion.fence_offset`).

Before packing a bucket into a ring slot, the packing stream waits on the GPU
(cuStreamWaitValue32, GEQ) for the slot's counter to reach the sequence number of the
bucket packed there before; the daemon writes it once that bucket's reads are done. The
rank's thread never waits for the daemon: only for its own packing, to tell the daemon
which buckets are packed; with a pack counter (`packed`) not even for that: the packing
stream writes the counter after each bucket, and the daemon's copies wait on the GPU for
it. A version that did not land releases every slot counter (writes the version's last
sequence number from a stream of its own), so that no wait is left behind on the GPU,
whatever became of the daemon.
"""

from __future__ import annotations

import torch

from weightwire.memory.cudadrv import CudaError, Driver, driver

from .streams import OwnStreams

MASK = 0xFFFFFFFF


def sequence(base: int, bucket: int) -> int:
    """As `weightwire.daemon.slotfence.sequence` (the daemon writes these)."""
    return (base + bucket + 1) & MASK


class SlotWaits:
    """The counters' sequence numbers across versions, and the GPU waits on them."""

    def __init__(self) -> None:
        self.base = 0  # the next version's base: every version takes len(buckets) numbers
        self._usable: bool | None = None
        self._drv: Driver | None = None
        # a stream per device, never a pool stream (see `streams`): one that is the packing
        # stream waiting on these counters would queue the release behind that wait
        self._release = OwnStreams()

    def usable(self) -> bool:
        """Whether this process's CUDA driver has the stream memory operations (once)."""
        if self._usable is None:
            try:
                self._drv = driver()
                self._usable = self._drv.stream_mem_ops()
            except CudaError:
                self._usable = False
        return self._usable

    def fresh(self, counters: torch.Tensor) -> None:
        """New counters (new staging; the pack counter too): all at `base`, which no wait
        of a later version takes as reached (none of them is written yet)."""
        counters.fill_(_signed(self.base))

    def wait(self, counters: torch.Tensor, slot: int, bucket: int) -> None:
        """The current stream of the counters' device waits until `slot`'s counter has
        reached bucket `bucket`'s sequence number (of the version begun at `base`)."""
        assert self._drv is not None
        device = counters.device
        self._drv.use(device.index if device.index is not None else torch.cuda.current_device())
        stream = torch.cuda.current_stream(device).cuda_stream
        address = counters.data_ptr() + 4 * slot
        self._drv.wait_value32(stream, address, sequence(self.base, bucket))

    def packed(self, gate: torch.Tensor, bucket: int) -> None:
        """The current stream of the pack counter's device (the packing stream) writes
        bucket `bucket`'s sequence number into it once the work queued so far (the bucket's
        packing) is done: the daemon's copies of the bucket wait on the GPU for that
        (`BeginVersion.gate_offset`). Packing is in bucket order on this one stream, so the
        counter only grows."""
        assert self._drv is not None
        device = gate.device
        self._drv.use(device.index if device.index is not None else torch.cuda.current_device())
        stream = torch.cuda.current_stream(device).cuda_stream
        self._drv.write_value32(stream, gate.data_ptr(), sequence(self.base, bucket))

    def release(self, counters: torch.Tensor, buckets: int) -> None:
        """The version did not land: every counter to its last sequence number, from a
        stream of its own (the packing stream may be waiting on them)."""
        assert self._drv is not None
        device = counters.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._release.get(torch.device("cuda", index))
        self._drv.use(index)
        last = sequence(self.base, buckets - 1)
        for slot in range(counters.numel()):
            self._drv.write_value32(stream.cuda_stream, counters.data_ptr() + 4 * slot, last)

    def advance(self, buckets: int) -> None:
        """A version used `buckets` sequence numbers (landed or not)."""
        self.base = (self.base + buckets) & MASK


def _signed(value: int) -> int:
    """A 32-bit counter's value as torch's int32 holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value
