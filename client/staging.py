"""A trainer rank's staging region: where its buckets are packed, in the engines' layout.

On the GPU (the default when the rank's tensors are there: packing runs on the GPU and
the daemon copies GPU to GPU), or in host memory shared with the daemon: the CPU replica,
pinned so that GPU-to-host packing runs at full speed, registered once.
"""

from __future__ import annotations

from typing import Literal

import torch

from weightwire.memory.hostmem import SHM_DIR, SharedFile, create_shared
from weightwire.protocol.local import RegisterRegion

from . import cuda

Placement = Literal["cpu", "gpu"]
FENCE_ALIGN = 256  # where slot counters start past the ring's bytes


class Staging:
    def __init__(
        self,
        nbytes: int,
        placement: Placement,
        device: torch.device,
        gid: int,
        rank: int,
        directory: str = SHM_DIR,
        fence_slots: int = 0,
        gate: bool = False,
    ):
        """`fence_slots`: GPU staging ends with that many 32-bit ring-slot counters, at
        `fence_offset` (past `nbytes`), registered with it (`BeginVersion.fence_offset`);
        `gate`: and one more word past them, the pack counter (`gate_offset`,
        `BeginVersion.gate_offset`)."""
        self.nbytes = nbytes
        self.placement = placement
        self.shared: SharedFile | None = None
        self._pinned = False
        self.fence_slots = fence_slots if placement == "gpu" else 0
        self.gate = gate and placement == "gpu"
        words = self.fence_slots + self.gate
        self.fence_offset = -(-nbytes // FENCE_ALIGN) * FENCE_ALIGN if words else -1
        self.gate_offset = self.fence_offset + 4 * self.fence_slots if self.gate else -1
        self.words: torch.Tensor | None = None  # the slot counters, then the pack counter
        self.counters: torch.Tensor | None = None
        self.gate_word: torch.Tensor | None = None
        self.length = self.fence_offset + 4 * words if words else nbytes  # what registers
        if placement == "gpu":
            self.tensor = torch.zeros(self.length, dtype=torch.uint8, device=device)
            self._whole = self.tensor  # what registers: the ring's bytes and its counters
            if words:
                self.words = self.tensor[self.fence_offset :].view(torch.int32)
                if self.fence_slots:
                    self.counters = self.words[: self.fence_slots]
                if self.gate:
                    self.gate_word = self.words[self.fence_slots :]
                self.tensor = self.tensor[:nbytes]
        else:
            self.shared = create_shared(
                nbytes, purpose=f"staging-r{rank}", gid=gid, directory=directory
            )
            self.tensor = torch.frombuffer(self.shared.map, dtype=torch.uint8)
            self.tensor.zero_()  # touch every page now, not in the first version
            if torch.cuda.is_available() and device.type == "cuda":
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                rc = cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
                self._pinned = int(rc) == 0

    def request(self, fd_socket: str = "") -> RegisterRegion:
        """What registers it (made anew each time: VMM memory's fds go with one request)."""
        if self.shared is not None:
            return RegisterRegion(path=self.shared.path, length=self.nbytes, purpose="staging")
        length = self.length
        info = cuda.region_of(
            self._whole, fd_socket=fd_socket, what="the staging buffer", prefer_ipc=True
        )
        return RegisterRegion(length=length, purpose="staging", kind="gpu", cuda=info)

    def close(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        if self.shared is not None:
            del self.tensor
            self.shared.detach()  # a view of it may live on: its memory goes with it
            self.shared.close()
            self.shared = None
