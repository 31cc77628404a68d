"""This node's view of the cluster: who is a member, who is lost, who coordinates.

Mutated only by the peer side (cluster.py); read by the others through `Joining` and the
`members` mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightwire.protocol.peer import Member

from .coordinator import Coordinator


@dataclass
class Membership:
    node: str
    incarnation: str
    coordinator: Coordinator | None = None  # this node's coordinator role, when configured
    coordinator_name: str | None = None  # the coordinator this node joined
    coordinator_incarnation: str | None = None
    members: dict[str, Member] = field(default_factory=dict)  # as the coordinator last sent
    lost: set[str] = field(default_factory=set)

    def bindings(self) -> dict[str, Member]:
        """Node name -> member (and so its key): the coordinator's own table where this node
        coordinates, else the membership the coordinator last sent."""
        return self.coordinator.members if self.coordinator is not None else self.members

    def waiting_for(self, job: str) -> str:
        if self.coordinator_name is None:
            return f"no plan for job {job!r}: not joined to the coordinator yet"
        if self.coordinator is not None:
            return f"no plan for job {job!r} yet; waiting for {self.coordinator.missing(job)}"
        return f"no plan for job {job!r} yet: the coordinator is waiting for more ranks"
