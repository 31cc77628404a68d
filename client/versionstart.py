"""How a trainer rank begins a version with its daemon, and what the version's publish
reports at its end.

The plan is fetched once (the daemon answers when every rank of the job has registered)
and again when it may be stale. Each version's staging, delta-out region, ring, slot
counters and pack counter follow from the plan; `BeginVersion` is tried up to three times
while the daemon says a new plan is coming (a peer restarted, ranks changed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.local import BeginVersion, GetPlan, PlanReply, PublishResult
from weightwire.protocol.plan import RankPlan, StagingRing

from .connection import DaemonConnection, expect
from .delta.sender import DeltaSender
from .posting import Poster, PublishStats, bucket_times
from .rankstaging import RankStaging
from .slotwait import SlotWaits


class SlotCounts(Protocol):
    """How many ring slots a version freed each way (`slotreuse.VersionSlots`)."""

    by_event: int
    by_landing: int
    by_counter: int


@dataclass(frozen=True)
class Begun:
    """A version the daemon accepted: the plan and memory it is packed with."""

    plan: RankPlan
    staging: torch.Tensor | None
    device: torch.device  # where it is packed
    out: torch.Tensor | None  # the delta-out region (delta-capable plans)
    ring: StagingRing
    counters: torch.Tensor | None  # the slot counters the GPU waits on, if used
    gate: torch.Tensor | None  # the pack counter the daemon's copies wait on, if used
    seconds: float  # from the publish call until the daemon accepted the version
    request_seconds: float  # of it, the BeginVersion request's round trip alone


class VersionStart:
    """The rank's plan (fetched once, forgotten when it may be stale: a registration, a
    daemon restart, a plan change the daemon reported) and each version begun on it."""

    def __init__(
        self,
        conn: DaemonConnection,
        stage: RankStaging,
        device: Callable[[], torch.device],
        slots: SlotWaits,
    ) -> None:
        self._conn, self._stage, self._device, self._slots = conn, stage, device, slots
        self._plan: RankPlan | None = None
        self._outdated = ""  # a plan hash the next plan must differ from ("": any)

    def plan(self, timeout_s: float) -> RankPlan:
        if self._plan is None:
            t = timeout_s
            ask = GetPlan(timeout_s=t, after_plan=self._outdated)
            self._plan = expect(self._conn.request(ask, t + 5), PlanReply).plan
            self._outdated = ""
        return self._plan

    def forget_plan(self, declared: bool = False) -> None:
        """The plan is asked for again at the next version; `declared`: this rank declared
        tensors, so the plan it had (which does not know them) will not do: the daemon
        answers with a newer one (before, a version could begin on the old plan, the
        coordinator not having replanned yet, and leave the new tensors out)."""
        if declared and self._plan is not None:
            self._outdated = self._plan.plan_hash
        self._plan = None

    def begin(
        self,
        version: int,
        t0: float,
        timeout_s: float,
        events_on: Callable[[torch.device, StagingRing], bool],
    ) -> Begun:
        """Begin `version` (the publish started at `t0`); `events_on(device, ring)`: whether
        to ask for the daemon's CUDA IPC events (`BucketsIssued`)."""
        stage = self._stage
        for attempt in range(3):
            plan = self.plan(timeout_s)
            staging = stage.ensure_staging(plan)
            dev = staging.device if staging is not None else self._device()
            out = stage.ensure_delta_out(plan, dev)
            ring = stage.ring(plan)
            counters = stage.counters(plan, ring)
            gate = stage.gate(plan)
            try:
                t_req = time.perf_counter()
                self._conn.request(
                    BeginVersion(
                        version=version,
                        plan_hash=plan.plan_hash,
                        staging_buckets=ring.slots,
                        slot_events=counters is None and events_on(dev, ring),
                        fence_offset=stage.staging.fence_offset
                        if counters is not None and stage.staging is not None
                        else -1,
                        fence_base=self._slots.base,
                        gate_offset=stage.staging.gate_offset
                        if gate is not None and stage.staging is not None
                        else -1,
                    )
                )
                begun = time.perf_counter() - t0
                begin_request = time.perf_counter() - t_req
                return Begun(plan, staging, dev, out, ring, counters, gate, begun, begin_request)
            except PlanError as exc:  # a new plan is coming (a peer restarted, ranks changed)
                if exc.code not in (ErrorCode.PLAN_CHANGED, ErrorCode.NOT_READY) or attempt == 2:
                    raise
                self._plan = None
        raise AssertionError("unreachable: the third attempt returns or raises")


def publish_stats(
    version: int,
    begun: Begun,
    poster: Poster,
    result: PublishResult,
    pack_s: float,
    slots: SlotCounts,
    delta: DeltaSender,
    total_s: float,
) -> PublishStats:
    """What a version's publish reports: the daemon's `result`, this rank's packing."""
    return PublishStats(
        version=version,
        nbytes=result.nbytes,
        writes=result.writes,
        seconds=result.seconds,
        pack_seconds=pack_s,
        transfer_seconds=result.transfer_seconds,
        total_seconds=total_s,
        buckets=bucket_times(begun.plan, poster, result),
        delta_bytes=result.delta_bytes,
        density=delta.last_density,
        replicas=result.replicas,
        slot_events=slots.by_event,
        slot_landings=slots.by_landing,
        slot_counters=slots.by_counter,
        gated=begun.gate is not None,
        begin_seconds=begun.seconds,
        begin_request_seconds=begun.request_seconds,
        compared=delta.last_compared,
        timeline=dict(result.timeline),
    )
