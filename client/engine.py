"""The engine side: receive tensors in place; learn when a version has fully landed."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import torch

from weightwire.memory.hostmem import SharedFile, create_shared
from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    RegistrationError,
)
from weightwire.protocol.local import (
    CudaRegion,
    DeclareDestinations,
    EngineLayout,
    LocalMessage,
    RegionRegistered,
    RegisterRegion,
    RemapRegion,
    VersionComplete,
    WaitVersion,
)
from weightwire.protocol.tensors import DestTensor

from .connection import aligned, expect
from .delta.receiver import DeltaReceiver, Target
from .dtypes import name_of
from .feeds import Recipe as Recipe  # also importable from here, as before
from .feeds import Rows as Rows
from .feeds import Source, pieces_of
from .inputs import index_of, tensors_of, timeout_of, version_of
from .notices import VersionInfo as VersionInfo  # importable from here, as before
from .notices import VersionNotices
from .rank import RankClient


@dataclass(frozen=True)
class _GpuSpan:
    """GPU memory registered as one region: device, [base, base + size), what it holds."""

    device: int
    base: int
    size: int
    what: str


def _device_of(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _what(members: list[tuple[str, torch.Tensor]]) -> str:
    names = [n for n, _ in members]
    shown = ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
    return f"parameter{'s' if len(names) > 1 else ''} {shown}"


class Engine(RankClient):
    """One engine rank. `register` moves its tensors into memory the daemon can write."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        socket: str | None = None,
        job: str = "default",
        timeout_s: float = 300.0,
        device: int | None = None,
        delta_area: float = 0.0,
        replica: int = -1,
        replica_size: int = 0,
    ) -> None:
        """`delta_area`: register a delta area of this fraction of the registered bytes
        (first `register` call): sources may then send sparse deltas, and every version is
        applied and verified here (checksums) before it is complete. 0: none.

        `replica` / `replica_size`: this rank belongs to engine replica `replica` (one
        engine: all its ranks, `replica_size` of them), which makes the job elastic: a
        replica that dies is dropped from versions without failing the others, and one that
        joins gets a plan of its own between versions (README, "Elastic engines")."""
        if not 0 <= delta_area <= 4:
            raise RegistrationError(f"delta_area {delta_area}: a fraction of the weights, 0..4")
        if (replica < 0) != (replica_size <= 0):
            raise ValueError("give both replica and replica_size, or neither")
        self._delta_fraction = delta_area
        self._delta: DeltaReceiver | None = None
        self._delta_request: RegisterRegion | None = None
        # before the session: notices may come as soon as it exists
        rank = index_of(rank, "rank")
        self._notices = VersionNotices(rank, lambda: self._delta, lambda m: self._conn.send(m))
        super().__init__(
            "engine",
            rank,
            world_size,
            socket=socket,
            job=job,
            timeout_s=timeout_s,
            device=device,
            replica=replica,
            replica_size=replica_size,
        )
        self._regions: list[SharedFile] = []
        self._buffers: list[torch.Tensor] = []
        # GPU memory registered, by index in _declared (-1: the delta area): its span
        self._gpu_spans: dict[int, _GpuSpan] = {}
        self._declared: list[
            tuple[RegisterRegion, tuple[DestTensor, ...], EngineLayout | None]
        ] = []

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        sources: Mapping[str, Source] | None = None,
        layout: EngineLayout | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive into these tensors from now on.

        GPU tensors are registered where they are (one region per CUDA allocation). Host
        tensors are moved, in place, into one shared region (their contents are kept).
        Either way the same tensor objects, e.g. a model's parameters, see every landed
        version. `sources` says what feeds each one: by default the whole source tensor of
        the same name; `Rows` for a dim-0 slice; `Recipe` for explicit pieces; None (with a
        `layout`) leaves it to the coordinator's rules.
        """
        tensors = tensors_of(tensors, "register")
        for name in set(tensors) & {t.name for _, specs, _ in self._declared for t in specs}:
            raise RegistrationError(  # refused here: the daemon would keep the region
                f"tensor {name} is already registered by this rank", code=ErrorCode.DUPLICATE
            )
        sources = sources or {}
        if not isinstance(sources, Mapping):
            raise RegistrationError(
                f"register: sources is a {type(sources).__name__}, not a mapping of name -> "
                "Rows or Recipe",
                code=ErrorCode.INVALID,
            )
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise RegistrationError(f"tensor {name} must be contiguous to receive in place")
        host = {n: t for n, t in tensors.items() if t.device.type == "cpu"}
        gpu = {n: t for n, t in tensors.items() if t.device.type == "cuda"}
        other = set(tensors) - set(host) - set(gpu)
        if other:
            raise RegistrationError(f"tensors on unsupported devices: {sorted(other)}")
        if self._delta_fraction and self._delta is None:
            self._register_delta_area(tensors)
        specs: list[DestTensor] = []
        if host:
            specs += self._register_host(host, sources, layout)
        if gpu:
            specs += self._register_gpu(gpu, sources, layout)
        return dict(tensors)

    def _register_delta_area(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The area delta payloads and trailers land in, on the tensors' device."""
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        nbytes = max(1 << 20, int(total * self._delta_fraction) // 64 * 64)
        gpu = next((t for t in tensors.values() if t.is_cuda), None)
        if gpu is not None:
            from . import cuda

            area = torch.zeros(nbytes, dtype=torch.uint8, device=gpu.device)
            base, size = cuda.span_of(area)
            start = area.data_ptr()
            span = _GpuSpan(_device_of(area), start, base + size - start, "the delta area")
            self._gpu_spans[-1] = span
            request = RegisterRegion(
                length=nbytes, purpose="delta", kind="gpu", cuda=self._cuda_region(span)
            )
        else:
            shared = create_shared(  # where the daemon maps regions from (its region_dir)
                nbytes,
                purpose=f"delta-r{self.rank}",
                gid=self._conn.socket_gid,
                directory=self._conn.region_dir,
            )
            self._regions.append(shared)
            area = torch.frombuffer(shared.map, dtype=torch.uint8)
            area.zero_()
            request = RegisterRegion(path=shared.path, length=nbytes, purpose="delta")
        receiver = DeltaReceiver(self.rank, area)
        receiver.region = expect(self._conn.request(request), RegionRegistered).region
        self._delta, self._delta_request = receiver, request

    @property
    def delta(self) -> DeltaReceiver | None:
        """The delta area and what this rank's bytes hold (`held`), when it has one."""
        return self._delta

    def _targets(self, placed: list[tuple[str, torch.Tensor, int]], region: int) -> None:
        if self._delta is not None:
            self._delta.add_targets(
                [
                    Target(
                        region, off, t.numel() * t.element_size(), t.reshape(-1).view(torch.uint8)
                    )
                    for _, t, off in placed
                ]
            )

    def _declare(
        self,
        request: RegisterRegion,
        placed: list[tuple[str, torch.Tensor, int]],
        sources: Mapping[str, Source],
        layout: EngineLayout | None,
    ) -> list[DestTensor]:
        specs = tuple(  # what can be refused is, before the daemon maps the region
            DestTensor(
                name=name,
                dtype=name_of(t.dtype),
                shape=tuple(t.shape),
                region=-1,  # known once registered
                offset=off,
                pieces=pieces_of(name, t, sources.get(name), layout),
            )
            for name, t, off in placed
        )
        region = expect(self._conn.request(request), RegionRegistered).region
        specs = tuple(msgspec.structs.replace(t, region=region) for t in specs)
        self._conn.request(DeclareDestinations(tensors=specs, layout=layout))
        self._declared.append((request, specs, layout))
        return list(specs)

    def _register_host(
        self,
        tensors: Mapping[str, torch.Tensor],
        sources: Mapping[str, Source],
        layout: EngineLayout | None,
    ) -> list[DestTensor]:
        for name, t in tensors.items():
            whole, mine = t.untyped_storage().nbytes(), t.numel() * t.element_size()
            if whole > mine:
                warnings.warn(
                    f"host tensor {name} is {mine} bytes of a {whole}-byte buffer: it moves "
                    "into shared memory on its own, so whatever else reads that buffer (the "
                    "tensor it was cut from, another view of it) will not see new versions; "
                    "register the whole buffer instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
        offsets, end = aligned(t.numel() * t.element_size() for t in tensors.values())
        placed = [(name, t, off) for (name, t), off in zip(tensors.items(), offsets, strict=True)]
        with self._conn.region_file(end, f"engine-r{self.rank}") as shared:
            specs = self._declare(
                RegisterRegion(path=shared.path, length=shared.length), placed, sources, layout
            )
        buf = torch.frombuffer(shared.map, dtype=torch.uint8)
        self._regions.append(shared)
        self._buffers.append(buf)
        with torch.no_grad():
            for _, t, off in placed:
                view = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t)
                t.set_(view)  # type: ignore[call-overload]  # a tensor source: torch's stubs omit it
        if specs and self._delta is not None:  # the whole region: writes span tensors
            self._delta.add_targets([Target(specs[0].region, 0, buf.numel(), buf)])
        return specs

    def _register_gpu(
        self,
        tensors: Mapping[str, torch.Tensor],
        sources: Mapping[str, Source],
        layout: EngineLayout | None,
    ) -> list[DestTensor]:
        from . import cuda

        specs: list[DestTensor] = []
        for base, size, members in cuda.spans(tensors.items()):
            placed = [(name, t, t.data_ptr() - base) for name, t in members]
            span = _GpuSpan(_device_of(members[0][1]), base, size, _what(members))
            request = RegisterRegion(length=size, kind="gpu", cuda=self._cuda_region(span))
            declared = self._declare(request, placed, sources, layout)
            self._gpu_spans[len(self._declared) - 1] = span
            if declared:
                self._targets(placed, declared[0].region)
            specs += declared
        return specs

    def _cuda_region(self, span: _GpuSpan) -> CudaRegion:
        from . import cuda

        return cuda.region_at(span.device, span.base, span.size, self._conn.fd_socket, span.what)

    # --- SGLang's memory saver: GPU memory released and resumed --------------------

    def release_gpu_memory(self) -> None:
        """Before the GPU memory of the registered tensors is released (SGLang's
        `release_memory_occupation`, torch_memory_saver's `pause`): the daemon drops its
        mapping of every registered GPU region, so that releasing it gives the memory back
        (a mapping elsewhere would keep it allocated). Until `resume_gpu_memory`, writes
        into these regions fail, and so do the versions that make them: none is reported
        complete with bytes missing."""
        for i in sorted(self._gpu_spans):
            region = self._gpu_region(i)
            self._conn.request(RemapRegion(region=region))

    def resume_gpu_memory(self) -> None:
        """After the GPU memory is back at the same addresses (SGLang's
        `resume_memory_occupation`, torch_memory_saver's `resume`: new physical memory,
        same virtual addresses): hand every registered GPU region's memory to the daemon
        again (new IPC handles, or VMM allocations as new fds). The regions keep their ids
        and the tensors their places, so the daemon is not restarted and nothing is
        declared again; the next version lands in the new memory."""
        for i in sorted(self._gpu_spans):
            region = self._gpu_region(i)
            info = self._cuda_region(self._gpu_spans[i])
            self._conn.request(RemapRegion(region=region, cuda=info))
            if i < 0:
                assert self._delta_request is not None
                self._delta_request = msgspec.structs.replace(self._delta_request, cuda=info)
            else:
                request, specs, layout = self._declared[i]
                self._declared[i] = (msgspec.structs.replace(request, cuda=info), specs, layout)

    def _gpu_region(self, i: int) -> int:
        """The daemon's id of gpu span `i` (-1: the delta area)."""
        if i < 0:
            assert self._delta is not None
            return self._delta.region
        return self._declared[i][1][0].region

    def wait(self, version: int, timeout_s: float | None = None) -> VersionInfo:
        """Block until `version` has fully landed in this rank's tensors."""
        version, t = version_of(version), timeout_of(timeout_s, self.timeout_s)
        reply = expect(
            self._conn.request(WaitVersion(version=version, timeout_s=t), t + 5), VersionComplete
        )
        return VersionInfo(reply.version, reply.nbytes, reply.seconds)

    def on_version(self, callback: Callable[[VersionInfo | Exception], None]) -> None:
        """Call `callback` (on a weightwire thread) for every version that lands or fails.
        One that raises is logged, and the thread goes on: it also applies delta versions."""
        self._notices.callbacks.append(callback)

    @property
    def latest(self) -> VersionInfo | None:
        return self._notices.latest

    def _on_notify(self, msg: LocalMessage) -> None:
        self._notices.notify(msg)

    def _replay(self) -> None:
        """The daemon restarted: register the same memory again, on a fresh session."""
        self._conn.fail_pending(PeerLostError("the daemon restarted; wait again"))
        super()._replay()
        for i, span in self._gpu_spans.items():  # exported again: fds go with one request
            if i < 0 and self._delta_request is not None:
                info = self._cuda_region(span)
                self._delta_request = msgspec.structs.replace(self._delta_request, cuda=info)
            elif i >= 0:
                request, specs, layout = self._declared[i]
                info = self._cuda_region(span)
                self._declared[i] = (msgspec.structs.replace(request, cuda=info), specs, layout)
        if self._delta is not None and self._delta_request is not None:
            self._delta.held = -1
            self._delta.region = expect(
                self._conn.request(self._delta_request), RegionRegistered
            ).region
        renamed: dict[int, int] = {}
        for i, (request, specs, layout) in enumerate(self._declared):
            region = expect(self._conn.request(request), RegionRegistered).region
            if specs:
                renamed[specs[0].region] = region
            specs = tuple(msgspec.structs.replace(t, region=region) for t in specs)
            self._conn.request(DeclareDestinations(tensors=specs, layout=layout))
            self._declared[i] = (request, specs, layout)
        if self._delta is not None:
            self._delta.rename_regions(renamed)

    def close(self) -> None:
        super().close()
        if self._delta is not None:
            self._delta.close()
        for shared in self._regions:
            shared.detach()  # the weights may live on in the caller's tensors
        self._regions.clear()
        self._buffers.clear()
