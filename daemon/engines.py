"""The engine ranks' side of completion: what `Completions` tells an engine rank (a version
complete or failed, apply your deltas) and the nodes that write to it (its verdict)."""

from __future__ import annotations

from weightwire.protocol.local import (
    ApplyBucket,
    ApplyVersion,
    Verdict,
    VersionComplete,
    VersionFailed,
)
from weightwire.protocol.peer import BucketLanded, LandedPart, VersionVerdict

from .completion import RankCompletion
from .seams import PeerSend, RankLink


class EngineOutbox:
    def __init__(self, node: str, link: RankLink, mesh: PeerSend) -> None:
        self.node = node
        self._link = link
        self._mesh = mesh

    def notify(self, job: str, rank: int, msg: VersionComplete | VersionFailed) -> None:
        self._link.push(job, "engine", rank, msg)

    def apply(self, rc: RankCompletion, version: int) -> None:
        """Every write of `version` landed at an engine rank with a delta area: it applies
        the payloads and checks the trailers (against what the plan routes from each of
        their senders to it), then answers with `Applied`."""
        msg = ApplyVersion(
            rank=rc.rank,
            version=version,
            region=rc.expect.delta_region,
            trailers=rc.expect.trailers,
            plan=rc.plan_hash,
            senders=rc.expect.senders,
            planned=rc.expect.planned,
        )
        self._link.push(rc.job, "engine", rc.rank, msg)

    def apply_bucket(self, rc: RankCompletion, note: BucketLanded, part: LandedPart) -> None:
        """A bucket of a version in progress landed at an engine rank: it applies its
        payloads and checksums its ranges now, while later buckets travel. A note from a
        node under a trainer rank the plan does not have it write here is dropped (a
        dropped note costs nothing but time: `ApplyVersion` does what no note covered)."""
        senders = rc.expect.senders
        if senders and (note.source_node, note.source_rank) not in senders:
            return
        msg = ApplyBucket(
            rank=rc.rank,
            version=note.version,
            region=rc.expect.delta_region,
            sender=note.source_rank,
            bucket=note.bucket,
            ranges=part.ranges,
            payloads=part.payloads,
            plan=rc.plan_hash,
        )
        self._link.push(rc.job, "engine", rc.rank, msg)

    def verdict(self, rc: RankCompletion, version: int, ok: bool, code: str, message: str) -> None:
        """An engine rank's outcome of `version`, to every node that writes to it."""
        verdict = Verdict(
            node=self.node, slot=rc.expect.slot, rank=rc.rank, ok=ok, code=code, message=message
        )
        for node in rc.expect.sources:
            self._mesh.send_soon(node, VersionVerdict(job=rc.job, version=version, verdict=verdict))
