"""The trainer side: declare what this rank holds; `publish` each version on its own."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import (
    ErrorCode,
    PeerLostError,
    PlanError,
    RegistrationError,
    TimeoutError_,
    error_from_code,
)
from weightwire.protocol.local import (
    BeginVersion,
    BucketReady,
    DeclareSources,
    GetPlan,
    Hello,
    LocalMessage,
    PlanReply,
    PublishResult,
    RegionRegistered,
    RegisterRegion,
)
from weightwire.protocol.plan import RankPlan
from weightwire.protocol.tensors import SourceTensor
from weightwire.transport.hostmem import SharedFile, create_shared

from .connection import DaemonConnection, expect
from .dtypes import name_of
from .layouts import Full, Layout, local_box
from .pack import pack


@dataclass(frozen=True)
class PublishStats:
    version: int
    nbytes: int
    writes: int
    seconds: float  # from the daemon accepting the version until every write landed
    pack_seconds: float  # time spent packing buckets (overlaps the transfer)
    transfer_seconds: float  # from the first write posted until the last one landed
    total_seconds: float  # the whole publish call


@dataclass
class _Registered:
    tensor: torch.Tensor
    spec: SourceTensor


class Trainer:
    """One trainer rank. `publish` returns once this rank's writes have all landed."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        socket: str | None = None,
        job: str = "default",
        timeout_s: float = 300.0,
    ) -> None:
        self.rank, self.world_size, self.job, self.timeout_s = rank, world_size, job, timeout_s
        self._results: dict[int, Future[PublishResult]] = {}
        self._lock = threading.Lock()
        self._hello = Hello(
            protocol=PROTOCOL_VERSION,
            role="trainer",
            rank=rank,
            world_size=world_size,
            job=job,
            pid=os.getpid(),
            client="weightwire.client.Trainer",
        )
        self._conn = DaemonConnection(
            socket, on_notify=self._on_notify, on_reset=self._replay, on_lost=self._lost
        )
        self._conn.request(self._hello)
        self._tensors: dict[str, _Registered] = {}
        self._plan: RankPlan | None = None
        self._staging: SharedFile | None = None
        self._staging_tensor: torch.Tensor | None = None

    # --- registration --------------------------------------------------------

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout | Mapping[str, Layout] | None = None,
        global_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """Declare named tensors this rank holds, and which part of each global tensor.

        `layout` is one Layout for all, or one per name (default Full). For a sharded
        tensor give its global shape in `global_shapes` (default: the local shape).
        """
        specs = []
        for name, t in tensors.items():
            lay = layout.get(name, Full()) if isinstance(layout, Mapping) else (layout or Full())
            shape = tuple((global_shapes or {}).get(name, tuple(t.shape)))
            box = local_box(lay, shape, tuple(t.shape))
            spec = SourceTensor(name=name, dtype=name_of(t.dtype), shape=shape, box=box)
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

    def _ensure_staging(self, plan: RankPlan) -> torch.Tensor:
        need = max(plan.staging_bytes, 1)
        if self._staging is None or self._staging.length < need:
            shared = create_shared(need, purpose=f"staging-r{self.rank}", gid=self._conn.socket_gid)
            try:
                expect(
                    self._conn.request(
                        RegisterRegion(path=shared.path, length=need, purpose="staging")
                    ),
                    RegionRegistered,
                )
            except BaseException:
                shared.unlink()
                shared.close()
                raise
            if self._staging is not None:
                self._staging.unlink()
            self._staging = shared
            self._staging_tensor = torch.frombuffer(shared.map, dtype=torch.uint8)
            self._staging_tensor.zero_()
        assert self._staging_tensor is not None
        return self._staging_tensor

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
        pack_s = 0.0
        for bucket in plan.buckets:
            p0 = time.perf_counter()
            for op in bucket.packs:
                pack(op, current[op.source], staging)
            pack_s += time.perf_counter() - p0
            self._conn.send(BucketReady(version=version, bucket=bucket.index))
        try:
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
        return PublishStats(
            version=version,
            nbytes=result.nbytes,
            writes=result.writes,
            seconds=result.seconds,
            pack_seconds=pack_s,
            transfer_seconds=result.transfer_seconds,
            total_seconds=time.perf_counter() - t0,
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

    def _on_notify(self, msg: LocalMessage) -> None:
        if isinstance(msg, PublishResult):
            with self._lock:
                fut = self._results.get(msg.version)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _replay(self) -> None:
        """The daemon restarted: register everything again, on a fresh session."""
        self._fail_pending(PeerLostError("the daemon restarted mid-version; publish again"))
        self._conn.request(self._hello)
        if self._tensors:
            self._conn.request(
                DeclareSources(tensors=tuple(r.spec for r in self._tensors.values()))
            )
        if self._staging is not None:
            self._conn.request(
                RegisterRegion(
                    path=self._staging.path, length=self._staging.length, purpose="staging"
                )
            )
        self._plan = None

    def _lost(self) -> None:
        self._fail_pending(
            PeerLostError(
                f"the daemon at {self._conn.path} has not answered for "
                f"{self._conn.lost_after_s:.0f} s"
            )
        )

    def _fail_pending(self, exc: Exception) -> None:
        self._conn.fail_pending(exc)
        with self._lock:
            pending = list(self._results.values())
        for fut in pending:
            if not fut.done():
                fut.set_exception(exc)

    def close(self) -> None:
        self._conn.close()
        if self._staging is not None:
            self._staging_tensor = None
            self._staging.unlink()
            self._staging.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
