"""The canonical log line: one per job per version on each daemon.

Each local rank's finish (a `Recorder` call) is gathered under (job, version); when every
rank of the job on this node has finished it, one line says what this node did for that
version: bytes sent and received, time, throughput, the peer nodes, the outcome. A version
some local rank never finishes (it skipped it, or left) is logged `partial` once it is
older than `stale_s`, naming the ranks that did not report.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("weightwire.daemon")

LocalRanks = Callable[[str], set[tuple[str, int]]]
"""local_ranks(job): the (role, rank) pairs of `job` on this node now."""


@dataclass
class _Entry:
    opened: float = field(default_factory=time.monotonic)
    ranks: dict[tuple[str, int], tuple[int, float, str | None]] = field(default_factory=dict)
    peers: set[str] = field(default_factory=set)
    timelines: dict[int, Mapping[str, float]] = field(default_factory=dict)  # trainer ranks'


def gbyte_s(nbytes: int, seconds: float) -> float | None:
    """Decimal gigabytes per second, the unit of every `gbyte_s` log field."""
    return round(nbytes / seconds / 1e9, 6) if seconds > 0 else None


class VersionLog:
    def __init__(self, local_ranks: LocalRanks, stale_s: float) -> None:
        self.local_ranks = local_ranks
        self.stale_s = stale_s
        self.open: dict[tuple[str, int], _Entry] = {}
        self.logged: deque[tuple[str, int]] = deque(maxlen=256)  # late reports are dropped

    def bucket_landed(self, job: str, seconds: float) -> None:
        pass

    def rank_version(
        self,
        job: str,
        role: str,
        rank: int,
        version: int,
        nbytes: int,
        seconds: float,
        peers: Mapping[str, int],
        code: str | None,
        timeline: Mapping[str, float] | None = None,
    ) -> None:
        if (job, version) in self.logged:
            return
        entry = self.open.setdefault((job, version), _Entry())
        if timeline:
            entry.timelines[rank] = timeline
        entry.ranks[(role, rank)] = (nbytes, seconds, code)
        entry.peers.update(peers)
        if self.local_ranks(job) <= set(entry.ranks):
            self._emit(job, version, entry, missing=set())

    def flush(self, now: float | None = None) -> None:
        """Logs the versions some rank never finished, once they are `stale_s` old."""
        now = time.monotonic() if now is None else now
        for (job, version), entry in list(self.open.items()):
            if now - entry.opened >= self.stale_s:
                self._emit(job, version, entry, self.local_ranks(job) - set(entry.ranks))

    def _emit(self, job: str, version: int, entry: _Entry, missing: set[tuple[str, int]]) -> None:
        del self.open[(job, version)]
        self.logged.append((job, version))
        sent = sum(n for (role, _), (n, _, _) in entry.ranks.items() if role == "trainer")
        received = sum(n for (role, _), (n, _, _) in entry.ranks.items() if role == "engine")
        seconds = max((s for _, s, _ in entry.ranks.values()), default=0.0)
        failed = {f"{role} {rank}": c for (role, rank), (_, _, c) in entry.ranks.items() if c}
        outcome = "failed" if failed else "partial" if missing else "ok"
        fields: dict[str, object] = {
            "job": job,
            "version": version,
            "outcome": outcome,
            "trainer_ranks": sorted(r for role, r in entry.ranks if role == "trainer"),
            "engine_ranks": sorted(r for role, r in entry.ranks if role == "engine"),
            "bytes_sent": sent,
            "bytes_received": received,
            "seconds": round(seconds, 6),
            "gbyte_s": gbyte_s(max(sent, received), seconds),
            "peers": sorted(entry.peers),
        }
        if entry.timelines:  # each trainer rank's first events, ms after it began
            fields["start_ms"] = {
                str(rank): {k: round(v * 1e3, 3) for k, v in t.items()}
                for rank, t in sorted(entry.timelines.items())
            }
        if failed:
            fields["failed"] = failed
        if missing:
            fields["not_reported"] = sorted(f"{role} {rank}" for role, rank in missing)
        (log.info if outcome == "ok" else log.warning)("version", **fields)
