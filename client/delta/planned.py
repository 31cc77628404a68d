"""What the plan lets each sender write at one engine rank (no I/O): per trailer its
sender rank, per sender the ranges the plan routes from it there (`Expect.planned`, told
by `ApplyVersion`). A sender's trailer must name exactly those, each once, in any order;
a bucket's ranges must be among them. Its payloads' blocks must be among its trailer's or
bucket's ranges, so a payload never writes into another rank's bytes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from weightwire.protocol.errors import ErrorCode
from weightwire.protocol.local import ApplyVersion

from . import frames


class PlanRefused(ValueError):
    """A trailer or bucket names what the plan does not route from its sender."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNAUTHORIZED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Planned:
    """What one plan routes to engine rank `rank`: per sender rank its ranges (as a set)
    and how many (a trailer names each once)."""

    plan: str
    rank: int
    senders: tuple[tuple[str, int], ...]  # (node, rank) of each trailer
    ranges: dict[int, frozenset[frames.Range]]
    counts: dict[int, int]

    @staticmethod
    def told(msg: ApplyVersion, kept: Planned | None) -> Planned | None:
        """What `msg` says (`kept` when it says the same plan again); None from a daemon
        that does not say."""
        if not msg.senders and not msg.planned:
            return None
        if not len(msg.senders) == len(msg.planned) == len(msg.trailers):
            raise PlanRefused(
                f"{len(msg.trailers)} trailers, {len(msg.senders)} senders and "
                f"{len(msg.planned)} planned range lists: they go in pairs",
                ErrorCode.INVALID,
            )
        if kept is not None and msg.plan and kept.plan == msg.plan and kept.senders == msg.senders:
            return kept
        ranks = [rank for _, rank in msg.senders]
        return Planned(
            msg.plan,
            msg.rank,
            msg.senders,
            {rank: frozenset(r) for rank, r in zip(ranks, msg.planned, strict=True)},
            {rank: len(r) for rank, r in zip(ranks, msg.planned, strict=True)},
        )

    def check(self, sender: int, ranges: Iterable[frames.Range], what: str) -> None:
        """PlanRefused unless every one of `ranges` (of sender rank `sender`'s `what`) is
        one the plan routes from that rank here."""
        allowed = self.ranges.get(sender)
        if allowed is None:
            raise PlanRefused(
                f"sender rank {sender}'s {what}: the plan has it write nothing to engine "
                f"rank {self.rank}"
            )
        stray = next((r for r in ranges if r not in allowed), None)
        if stray is not None:
            raise PlanRefused(
                f"sender rank {sender}'s {what} names range {stray}, not one the plan routes "
                f"from it to engine rank {self.rank}"
            )

    def check_trailers(self, trailers: list[frames.TrailerHead]) -> None:
        """PlanRefused unless each trailer is its planned sender's and names exactly the
        ranges the plan routes from it here."""
        for (_, rank), tr in zip(self.senders, trailers, strict=True):
            if tr.sender != rank:
                raise PlanRefused(
                    f"the trailer of trainer rank {rank} says it is of sender rank {tr.sender}"
                )
            self.check(rank, tr.ranges, "trailer")
            n = self.counts[rank]
            if len(tr.ranges) != n or len(set(tr.ranges)) != len(self.ranges[rank]):
                raise PlanRefused(
                    f"sender rank {rank}'s trailer names {len(tr.ranges)} ranges, not the {n} "
                    f"the plan routes from it to engine rank {self.rank}, each once"
                )
