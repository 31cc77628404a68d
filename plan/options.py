"""The knobs of the plan."""

from __future__ import annotations

import msgspec


class PlanOptions(msgspec.Struct, frozen=True, kw_only=True):
    bucket_bytes: int = 256 << 20
    max_write_bytes: int = 32 << 20
    min_stripe_bytes: int = 1 << 20  # a write is striped over lanes only in parts this large
    allow_unused_sources: bool = False
    # delta-capable plans: every copy of a chunk (one per engine replica with the same
    # layout) is sent by one trainer rank, so it is staged, compared and encoded once
    share_keys: bool = False
