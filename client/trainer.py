"""The trainer side: declare what this rank holds; `publish` each version on its own."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    PlanError,
    RegistrationError,
    TimeoutError_,
    error_from_code,
)
from weightwire.protocol.local import (
    AbortVersion,
    BeginVersion,
    DeclareSources,
    GetPlan,
    LocalMessage,
    PlanReply,
    PublishResult,
    RegionRegistered,
    RegisterRegion,
)
from weightwire.protocol.plan import RankPlan
from weightwire.protocol.tensors import SourceTensor
from weightwire.transport.hostmem import SharedFile, create_shared

from . import cuda
from .connection import expect
from .dtypes import name_of
from .layouts import Full, Layout, local_box
from .pack import Packer
from .posting import BucketTimes, Poster, PublishStats
from .rank import RankClient
from .staging import Staging


@dataclass
class _Registered:
    tensor: torch.Tensor
    spec: SourceTensor


class Trainer(RankClient):
    """One trainer rank. `publish` returns once this rank's writes have all landed."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        socket: str | None = None,
        job: str = "default",
        timeout_s: float = 300.0,
        device: int | None = None,
        staging: Literal["auto", "gpu", "cpu"] = "auto",
    ) -> None:
        """`staging`: where buckets are packed. "gpu" (the default when the tensors are on a
        GPU) keeps everything on the device; "cpu" is the pinned CPU replica in the
        engines' layout (host memory the daemon sends from, e.g. over tcp or RDMA)."""
        self.placement = staging
        self._results: dict[int, Future[PublishResult]] = {}
        self._lock = threading.Lock()
        super().__init__(
            "trainer",
            rank,
            world_size,
            socket=socket,
            job=job,
            timeout_s=timeout_s,
            device=device,
        )
        self._tensors: dict[str, _Registered] = {}
        self._plan: RankPlan | None = None
        self._staging: Staging | None = None
        self._sources: list[tuple[int, SharedFile, torch.Tensor]] = []  # (region, file, bytes)
        # allocation base -> (region, size, its registration)
        self._gpu_sources: dict[int, tuple[int, int, RegisterRegion]] = {}
        self._packer = Packer()

    # --- registration --------------------------------------------------------

    def allocate(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Tensors that live in memory the daemon reads directly (zero-copy sources).

        Registered later with `register`, their untransformed parts are written to the
        engines straight from here: no packing, no staging copy (the CPU-replica way). Keep
        them unchanged while a publish runs.
        """
        placed, offset = [], 0
        for name, (shape, dtype) in specs.items():
            offset = -(-offset // 256) * 256
            placed.append((name, shape, dtype, offset))
            offset += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        shared = create_shared(
            max(offset, 1),
            purpose=f"sources-r{self.rank}",
            gid=self._conn.socket_gid,
            directory=self._conn.region_dir,
        )
        try:
            region = expect(
                self._conn.request(
                    RegisterRegion(path=shared.path, length=shared.length, purpose="sources")
                ),
                RegionRegistered,
            ).region
        except BaseException:
            shared.unlink()
            shared.close()
            raise
        raw = torch.frombuffer(shared.map, dtype=torch.uint8)
        self._sources.append((region, shared, raw))
        out = {}
        for name, shape, dtype, off in placed:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            out[name] = raw[off : off + n].view(dtype).view(shape)
        return out

    def _region_of(self, t: torch.Tensor, zero_copy: bool = False) -> tuple[int, int]:
        """(region, byte offset) of a tensor allocated by `allocate`, or, with `zero_copy`,
        of a GPU tensor in its allocation (registered on first use); else (-1, 0)."""
        if not t.is_contiguous():
            return -1, 0
        if t.is_cuda:
            return self._gpu_region_of(t) if zero_copy else (-1, 0)
        if t.device.type != "cpu":
            return -1, 0
        for region, _, raw in self._sources:
            base = raw.data_ptr()
            if base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + raw.numel():
                return region, t.data_ptr() - base
        return -1, 0

    def _gpu_region_of(self, t: torch.Tensor) -> tuple[int, int]:
        base, size = cuda.allocation_of(t)
        known = self._gpu_sources.get(base)
        if known is None:
            request = RegisterRegion(
                length=size, purpose="sources", kind="gpu", cuda=cuda.region_of(t, base=base)
            )
            region = expect(self._conn.request(request), RegionRegistered).region
            known = self._gpu_sources[base] = (region, size, request)
        return known[0], t.data_ptr() - base

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout | Mapping[str, Layout] | None = None,
        global_shapes: Mapping[str, tuple[int, ...]] | None = None,
        *,
        zero_copy: bool = False,
    ) -> None:
        """Declare named tensors this rank holds, and which part of each global tensor.

        `layout` is one Layout for all, or one per name (default Full). For a sharded
        tensor give its global shape in `global_shapes` (default: the local shape).

        `zero_copy=True`: the daemon reads the GPU tensors' own memory (their allocations,
        registered once here through CUDA IPC) for every part the engines take unchanged
        and contiguous, with no packing. Keep such tensors where they are (no re-allocation)
        and unchanged while a publish runs; publish them as registered (no replacements).
        Tensors from `Trainer.allocate` are always zero-copy.
        """
        specs = []
        for name, t in tensors.items():
            lay = layout.get(name, Full()) if isinstance(layout, Mapping) else (layout or Full())
            shape = tuple((global_shapes or {}).get(name, tuple(t.shape)))
            box = local_box(lay, shape, tuple(t.shape))
            region, offset = self._region_of(t, zero_copy)
            spec = SourceTensor(
                name=name,
                dtype=name_of(t.dtype),
                shape=shape,
                box=box,
                region=region,
                offset=offset,
            )
            if name in self._tensors:
                raise RegistrationError(
                    f"tensor {name} is already registered", code=ErrorCode.DUPLICATE
                )
            specs.append(spec)
        self._conn.request(DeclareSources(tensors=tuple(specs)))
        for spec in specs:
            self._tensors[spec.name] = _Registered(tensors[spec.name], spec)
        self._plan = None

    # --- publishing ----------------------------------------------------------

    def plan(self, timeout_s: float | None = None) -> RankPlan:
        """This rank's plan (waits until every rank of the job has registered)."""
        if self._plan is None:
            t = timeout_s or self.timeout_s
            reply = expect(self._conn.request(GetPlan(timeout_s=t), t + 5), PlanReply)
            self._plan = reply.plan
        return self._plan

    def prepare(self, timeout_s: float | None = None) -> RankPlan:
        """Fetch the plan and register the staging region now, not in the first publish.

        Waits until every rank of the job has registered. The staging memory is touched
        once here, so no version pays for page faults.
        """
        plan = self.plan(timeout_s)
        self._ensure_staging(plan)
        return plan

    def _device(self) -> torch.device:
        for r in self._tensors.values():
            if r.tensor.is_cuda:
                return r.tensor.device
        return torch.device("cpu")

    def _ensure_staging(self, plan: RankPlan) -> torch.Tensor | None:
        if not plan.staging_bytes:  # everything is written from zero-copy sources
            return None
        need = plan.staging_bytes
        if self._staging is None or self._staging.nbytes < need:
            device = self._device()
            placement = self.placement
            if placement == "auto":
                placement = "gpu" if device.type == "cuda" else "cpu"
            staging = Staging(
                need, placement, device, self._conn.socket_gid, self.rank, self._conn.region_dir
            )
            try:
                expect(self._conn.request(staging.request()), RegionRegistered)
            except BaseException:
                staging.close()
                raise
            if self._staging is not None:
                self._staging.close()
            self._staging = staging
        return self._staging.tensor

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> PublishStats:
        """Send this rank's part of `version`; returns once all of it has landed.

        `tensors` replaces registered tensors by name for this call (same dtype and
        shape); by default the registered tensors are read as they are now.
        """
        t0 = time.perf_counter()
        current = self._current(tensors)
        for attempt in range(3):
            plan = self.plan()
            staging = self._ensure_staging(plan)
            try:
                self._conn.request(BeginVersion(version=version, plan_hash=plan.plan_hash))
                break
            except PlanError as exc:  # a new plan is coming (a peer restarted, ranks changed)
                if exc.code not in (ErrorCode.PLAN_CHANGED, ErrorCode.NOT_READY) or attempt == 2:
                    raise
                self._plan = None
        fut: Future[PublishResult] = Future()
        with self._lock:
            self._results[version] = fut
        poster = Poster(self._conn, version)
        pack_s = 0.0
        try:
            try:
                for bucket in plan.buckets:
                    p0 = time.perf_counter()
                    started = time.time()
                    if bucket.packs:
                        assert staging is not None
                        self._packer.pack_bucket(bucket.packs, current, staging)
                    device = staging.device if staging is not None else self._device()
                    poster.post(bucket.index, device, started)
                    pack_s += time.perf_counter() - p0
                poster.finish()
            except Exception as exc:
                poster.abandon()
                self._abort(version, f"packing failed on trainer rank {self.rank}: {exc!r}")
                raise
            result = fut.result(self.timeout_s)
        except TimeoutError:
            raise TimeoutError_(
                f"version {version} of trainer rank {self.rank} did not land within "
                f"{self.timeout_s:.0f} s"
            ) from None
        finally:
            with self._lock:
                self._results.pop(version, None)
        if not result.ok:
            raise error_from_code(result.code, f"version {version}: {result.message}")
        times = tuple(
            BucketTimes(
                index=b.index,
                nbytes=b.nbytes,
                prepare_start=poster.started.get(b.index, 0.0),
                prepared=poster.ready.get(b.index, 0.0),
                posted=result.buckets[b.index][0] if b.index < len(result.buckets) else 0.0,
                landed=result.buckets[b.index][1] if b.index < len(result.buckets) else 0.0,
            )
            for b in plan.buckets
        )
        return PublishStats(
            version=version,
            nbytes=result.nbytes,
            writes=result.writes,
            seconds=result.seconds,
            pack_seconds=pack_s,
            transfer_seconds=result.transfer_seconds,
            total_seconds=time.perf_counter() - t0,
            buckets=times,
        )

    def _current(self, tensors: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        current = {name: r.tensor for name, r in self._tensors.items()}
        for name, t in (tensors or {}).items():
            reg = self._tensors.get(name)
            if reg is None:
                raise RegistrationError(
                    f"publish got tensor {name!r}, which this rank never registered",
                    code=ErrorCode.UNKNOWN_TENSOR,
                )
            if reg.spec.region >= 0 and t is not reg.tensor:
                raise RegistrationError(
                    f"tensor {name} is zero-copy (the daemon reads its registered memory): "
                    "update it in place instead of passing another tensor to publish",
                    code=ErrorCode.INVALID,
                )
            if t.dtype != reg.tensor.dtype:
                raise RegistrationError(
                    f"tensor {name}: published as {t.dtype}, registered as {reg.tensor.dtype}",
                    code=ErrorCode.DTYPE_MISMATCH,
                )
            if t.shape != reg.tensor.shape:
                raise RegistrationError(
                    f"tensor {name}: published with shape {list(t.shape)}, registered with "
                    f"{list(reg.tensor.shape)}",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            current[name] = t
        return current

    def _abort(self, version: int, reason: str) -> None:
        """Tell the daemon the version will not be finished (its engines learn it failed);
        best effort: the caller raises the reason itself."""
        with contextlib.suppress(Exception):
            self._conn.request(AbortVersion(version=version, reason=reason), timeout_s=5)

    def _on_notify(self, msg: LocalMessage) -> None:
        if isinstance(msg, PublishResult):
            with self._lock:
                fut = self._results.get(msg.version)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _replay(self) -> None:
        """The daemon restarted: register everything again, on a fresh session."""
        self._fail_pending(PeerLostError("the daemon restarted mid-version; publish again"))
        super()._replay()
        self._reregister_sources()
        if self._tensors:
            self._conn.request(
                DeclareSources(tensors=tuple(r.spec for r in self._tensors.values()))
            )
        if self._staging is not None:
            self._conn.request(self._staging.request())
        self._plan = None

    def _reregister_sources(self) -> None:
        """Zero-copy source regions again (the new daemon numbers them anew), and the
        tensor specs pointed at their new ids."""
        renamed: dict[int, int] = {}
        for i, (old, shared, raw) in enumerate(self._sources):
            request = RegisterRegion(path=shared.path, length=shared.length, purpose="sources")
            renamed[old] = expect(self._conn.request(request), RegionRegistered).region
            self._sources[i] = (renamed[old], shared, raw)
        for base, (old, size, request) in list(self._gpu_sources.items()):
            renamed[old] = expect(self._conn.request(request), RegionRegistered).region
            self._gpu_sources[base] = (renamed[old], size, request)
        for reg in self._tensors.values():
            if reg.spec.region in renamed:
                reg.spec = msgspec.structs.replace(reg.spec, region=renamed[reg.spec.region])

    def _fail_pending(self, exc: Exception) -> None:
        super()._fail_pending(exc)
        with self._lock:
            pending = list(self._results.values())
        for fut in pending:
            if not fut.done():
                fut.set_exception(exc)

    def close(self) -> None:
        super().close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for _, shared, _ in self._sources:
            shared.unlink()
        self._sources.clear()
