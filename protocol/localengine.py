"""The local socket's messages of an engine rank's versions: waiting for one, its
outcome, and applying a delta version (bucket by bucket, then the whole)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .localbase import LocalMsg, Version
from .plan import Range
from .tensors import NonNeg


class WaitVersion(LocalMsg, frozen=True, tag="wait_version"):
    version: Version
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 300.0


class VersionComplete(LocalMsg, frozen=True, tag="version_complete"):
    rank: NonNeg
    version: Version
    nbytes: NonNeg = 0
    seconds: float = 0.0


class VersionFailed(LocalMsg, frozen=True, tag="version_failed"):
    rank: NonNeg
    version: Version
    code: str
    message: str


class ApplyVersion(LocalMsg, frozen=True, tag="apply_version"):
    """Every write of `version` has landed at engine rank `rank`: apply the delta payloads
    in its delta area (`region`), check the trailers (at `trailers`: offset, capacity), and
    answer with `Applied`. The version is complete only after that."""

    rank: NonNeg
    version: Version
    region: NonNeg
    trailers: tuple[tuple[NonNeg, NonNeg], ...]
    # the plan's (`Expect`): per trailer, the trainer rank that writes it and the ranges
    # routed from it here; a trailer or payload outside them fails the version
    plan: str = ""
    senders: tuple[tuple[str, NonNeg], ...] = ()  # (node, trainer rank)
    planned: tuple[tuple[Range, ...], ...] = ()


class ApplyBucket(LocalMsg, frozen=True, tag="apply_bucket"):
    """Every write of bucket `bucket` of sender rank `sender` to engine rank `rank` landed
    (the source saw them all land) before the version's end: apply its payloads (at
    `payloads`: offset, bytes in the delta area `region`) and checksum its `ranges`
    (region, offset, length, count, stride) now, overlapped with the buckets still on
    their way. No reply: `ApplyVersion` finishes the version, checking the trailers with
    these per-range checksums (and computing any a bucket's message did not bring)."""

    rank: NonNeg
    version: Version
    region: NonNeg
    sender: NonNeg
    bucket: NonNeg
    ranges: tuple[tuple[NonNeg, NonNeg, NonNeg, NonNeg, NonNeg], ...] = ()
    payloads: tuple[tuple[NonNeg, NonNeg], ...] = ()
    plan: str = ""  # the plan it is of: checked against what its last `ApplyVersion` said


class Applied(LocalMsg, frozen=True, tag="applied"):
    """An engine rank applied and verified `version` (ok), or why not. No reply."""

    rank: NonNeg
    version: Version
    ok: bool
    code: str = ""
    message: str = ""
    delta_bytes: NonNeg = 0
    seconds: float = 0.0
