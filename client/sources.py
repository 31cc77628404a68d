"""A trainer rank's zero-copy source memory: host memory from `Trainer.allocate` and GPU
allocations registered for `register(..., zero_copy=True)`, each a region of the daemon's,
registered once (and again, renumbered, after a daemon restart)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from weightwire.memory.hostmem import SharedFile
from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.local import RegionRegistered, RegisterRegion

from . import cuda
from .connection import DaemonConnection, aligned, expect


class SourceRegions:
    def __init__(self, conn: DaemonConnection, rank: int) -> None:
        self._conn, self._rank = conn, rank
        self._host: list[tuple[int, SharedFile, torch.Tensor]] = []  # (region, file, bytes)
        # allocation base -> (region, size, its registration)
        self._gpu: dict[int, tuple[int, int, RegisterRegion]] = {}

    def allocate(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Tensors in one new shared region (see `Trainer.allocate`)."""
        sizes = [
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in specs.values()
        ]
        offsets, end = aligned(sizes)
        with self._conn.region_file(end, f"sources-r{self._rank}") as shared:
            region = expect(
                self._conn.request(
                    RegisterRegion(path=shared.path, length=shared.length, purpose="sources")
                ),
                RegionRegistered,
            ).region
        raw = torch.frombuffer(shared.map, dtype=torch.uint8)
        self._host.append((region, shared, raw))
        out = {}
        for (name, (shape, dtype)), off, n in zip(specs.items(), offsets, sizes, strict=True):
            out[name] = raw[off : off + n].view(dtype).view(shape)
        return out

    def region_of(self, t: torch.Tensor, zero_copy: bool = False) -> tuple[int, int]:
        """(region, byte offset) of a tensor allocated by `allocate`, or, with `zero_copy`,
        of a GPU tensor in its allocation (registered on first use); else (-1, 0)."""
        if not t.is_contiguous():
            return -1, 0
        if t.is_cuda:
            return self._gpu_region_of(t) if zero_copy else (-1, 0)
        if t.device.type != "cpu":
            return -1, 0
        for region, _, raw in self._host:
            base = raw.data_ptr()
            if base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + raw.numel():
                return region, t.data_ptr() - base
        return -1, 0

    def _gpu_region_of(self, t: torch.Tensor) -> tuple[int, int]:
        base, size = cuda.allocation_of(t)
        known = self._gpu.get(base)
        if known is None:
            request = RegisterRegion(
                length=size,
                purpose="sources",
                kind="gpu",
                cuda=cuda.region_of(
                    t,
                    base=base,
                    fd_socket=self._conn.fd_socket,
                    what="a zero-copy source tensor",
                    prefer_ipc=True,
                ),
            )
            region = expect(self._conn.request(request), RegionRegistered).region
            known = self._gpu[base] = (region, size, request)
        return known[0], t.data_ptr() - base

    def host_bytes(self, region: int, offset: int, length: int) -> torch.Tensor:
        """Bytes of a host region from `allocate` (what a delta trailer's checksum reads)."""
        for rid, _, raw in self._host:
            if rid == region:
                return raw[offset : offset + length]
        raise RegistrationError(
            f"region {region} is GPU memory registered zero-copy: writes from it cannot be "
            "checksummed for an engine's delta area; register without zero_copy",
            code=ErrorCode.INVALID,
        )

    def register_again(self) -> dict[int, int]:
        """Every region again, with a (restarted) daemon that numbers them anew: old -> new."""
        renamed: dict[int, int] = {}
        for i, (old, shared, raw) in enumerate(self._host):
            request = RegisterRegion(path=shared.path, length=shared.length, purpose="sources")
            renamed[old] = expect(self._conn.request(request), RegionRegistered).region
            self._host[i] = (renamed[old], shared, raw)
        for base, (old, size, request) in list(self._gpu.items()):
            renamed[old] = expect(self._conn.request(request), RegionRegistered).region
            self._gpu[base] = (renamed[old], size, request)
        return renamed

    def close(self) -> None:
        for _, shared, _ in self._host:
            shared.detach()  # the tensors `allocate` gave out may live on
        self._host.clear()
