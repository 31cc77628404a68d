"""A trainer rank's staging: the ring its plan is packed through, the staging region (and
its slot counters and pack counter, where the GPU waits on them), and the delta-out region,
each registered with the daemon once and again only when a plan needs more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import msgspec
import torch

from weightwire.protocol.local import LocalMessage, LocalMsg, RegionRegistered, RegisterRegion
from weightwire.protocol.plan import RankPlan, StagingRing, staging_ring

from .connection import expect
from .direct import Direct
from .slotwait import SlotWaits
from .staging import Placement, Staging


class RegionSession(Protocol):
    """The daemon session, as staging uses it: region registration and what it offers."""

    region_dir: str
    fd_socket: str
    features: frozenset[str]

    @property
    def socket_gid(self) -> int: ...

    def request(self, msg: LocalMsg, timeout_s: float = 30.0) -> LocalMessage: ...


class StagingSettings(Protocol):
    """What the rank asks of its staging, settable between versions (see `Trainer`)."""

    placement: Literal["auto", "gpu", "cpu"]  # Trainer's `staging`
    staging_buckets: int
    slot_counters: bool
    gate_copies: bool


class RankStaging:
    def __init__(
        self,
        conn: RegionSession,
        rank: int,
        device: Callable[[], torch.device],
        slots: SlotWaits,
        direct: Direct | None,
        settings: StagingSettings,
    ) -> None:
        self._conn, self.rank, self._device = conn, rank, device
        self._slots, self._direct, self._settings = slots, direct, settings
        self._staging: Staging | None = None
        self._delta_out: Staging | None = None
        self._ring: tuple[tuple[str, int], StagingRing] | None = None  # of (plan, slots)

    @property
    def staging(self) -> Staging | None:
        return self._staging

    @property
    def delta_out(self) -> Staging | None:
        return self._delta_out

    def ring(self, plan: RankPlan) -> StagingRing:
        key = (plan.plan_hash, self._settings.staging_buckets)
        if self._ring is None or self._ring[0] != key:
            self._ring = (key, staging_ring(plan, self._settings.staging_buckets))
        return self._ring[1]

    @property
    def staging_bytes(self) -> int:
        return self._staging.nbytes if self._staging is not None else 0

    def ensure_staging(self, plan: RankPlan) -> torch.Tensor | None:
        ring = self.ring(plan)
        need = ring.nbytes
        if not need:  # everything is written from zero-copy sources
            return None
        device = self._device()
        placement: Placement = (
            ("gpu" if device.type == "cuda" else "cpu")
            if self._settings.placement == "auto"
            else self._settings.placement
        )
        fence = ring.slots if self._counters_wanted(plan, ring, placement) else 0
        gate = self._gate_wanted(plan, placement)
        if (
            self._staging is None
            or self._staging.nbytes < need
            or self._staging.fence_slots < fence
            or (gate and not self._staging.gate)
        ):
            staging = Staging(
                need,
                placement,
                device,
                self._conn.socket_gid,
                self.rank,
                self._conn.region_dir,
                fence_slots=fence,
                gate=gate,
            )
            if staging.words is not None:
                self._slots.fresh(staging.words)
            try:
                expect(self._conn.request(staging.request(self._conn.fd_socket)), RegionRegistered)
            except BaseException:
                staging.close()
                raise
            if self._staging is not None:
                self._staging.close()
            self._staging = staging
        return self._staging.tensor

    def _counters_wanted(self, plan: RankPlan, ring: StagingRing, placement: str) -> bool:
        return (
            self._settings.slot_counters
            and ring.slots > 0
            and placement == "gpu"
            and not plan.delta_bytes
            and self._direct is None  # in-place buckets land out of their slots' order
            and self._slots.usable()
        )

    def _gate_wanted(self, plan: RankPlan, placement: str) -> bool:
        return (
            self._settings.gate_copies
            and "pack_gate" in self._conn.features  # an older daemon would not wait for it
            and placement == "gpu"
            and not plan.delta_bytes
            and self._direct is None  # in-place buckets are posted once their bytes are there
            and self._slots.usable()
        )

    def gate(self, plan: RankPlan) -> torch.Tensor | None:
        """The staging's pack counter, where this version's copies wait on it."""
        st = self._staging
        if st is None or st.gate_word is None:
            return None
        return st.gate_word if self._gate_wanted(plan, st.placement) else None

    def counters(self, plan: RankPlan, ring: StagingRing) -> torch.Tensor | None:
        """The staging's slot counters, where this version waits for slots on them."""
        st = self._staging
        if st is None or st.counters is None or st.fence_slots < ring.slots:
            return None
        return st.counters if self._counters_wanted(plan, ring, st.placement) else None

    def ensure_delta_out(self, plan: RankPlan, device: torch.device) -> torch.Tensor | None:
        """The region this rank encodes delta payloads and trailers in (delta-capable plans),
        beside staging: on the staging's device, registered once."""
        if not plan.delta_bytes:
            return None
        if self._delta_out is None or self._delta_out.nbytes < plan.delta_bytes:
            placement: Placement = "gpu" if device.type == "cuda" else "cpu"
            out = Staging(
                plan.delta_bytes,
                placement,
                device,
                self._conn.socket_gid,
                self.rank,
                self._conn.region_dir,
            )
            try:
                expect(self._conn.request(self._delta_request(out)), RegionRegistered)
            except BaseException:
                out.close()
                raise
            if self._delta_out is not None:
                self._delta_out.close()
            self._delta_out = out
        return self._delta_out.tensor

    def _delta_request(self, out: Staging) -> RegisterRegion:
        return msgspec.structs.replace(out.request(self._conn.fd_socket), purpose="delta")

    def register_again(self) -> None:
        """The daemon restarted: the staging and delta-out regions registered again."""
        if self._staging is not None:
            self._conn.request(self._staging.request(self._conn.fd_socket))
        if self._delta_out is not None:
            self._conn.request(self._delta_request(self._delta_out))

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._delta_out is not None:
            self._delta_out.close()
            self._delta_out = None
