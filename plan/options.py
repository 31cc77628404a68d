"""The knobs of the plan."""

from __future__ import annotations

import msgspec


class PlanOptions(msgspec.Struct, frozen=True, kw_only=True):
    bucket_bytes: int = 256 << 20
    # the last bucket_bytes of each trainer rank's send go in buckets of at most this (and
    # chunks are cut to at most this), so less is left to cross the link and to be
    # applied and checked after the last bucket is packed (0, or >= bucket_bytes: off)
    tail_bytes: int = 64 << 20
    max_write_bytes: int = 32 << 20
    min_stripe_bytes: int = 1 << 20  # a write is striped over lanes only in parts this large
    allow_unused_sources: bool = False
    # delta-capable plans: every copy of a chunk (one per engine replica with the same
    # layout) is sent by one trainer rank, so it is staged, compared and encoded once
    share_keys: bool = False

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk: a bucket, or the tail's buckets where they are smaller."""
        tail = self.tail_bytes
        return tail if 0 < tail < self.bucket_bytes else self.bucket_bytes
