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


class Staging:
    def __init__(
        self,
        nbytes: int,
        placement: Placement,
        device: torch.device,
        gid: int,
        rank: int,
        directory: str = SHM_DIR,
    ):
        self.nbytes = nbytes
        self.placement = placement
        self.shared: SharedFile | None = None
        self._pinned = False
        if placement == "gpu":
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
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
        info = cuda.region_of(
            self.tensor, fd_socket=fd_socket, what="the staging buffer", prefer_ipc=True
        )
        return RegisterRegion(length=self.nbytes, purpose="staging", kind="gpu", cuda=info)

    def close(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        if self.shared is not None:
            del self.tensor
            self.shared.unlink()
            self.shared.close()
            self.shared = None
