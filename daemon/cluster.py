"""The peer side of the daemon: joining the coordinator, heartbeats, membership, losing and
regaining peers, and dispatching what other nodes send (the mesh's handler)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from weightwire.protocol import PROTOCOL_VERSION
from weightwire.protocol.errors import ErrorCode, PlanError
from weightwire.protocol.peer import (
    Advertise,
    AssignPlan,
    BucketLanded,
    Heartbeat,
    Member,
    Membership,
    PeerError,
    PeerHello,
    PeerMessage,
    PeerWelcome,
    PlanProblem,
    StatusAnswer,
    StatusQuery,
    TransportSignal,
    VersionAbort,
    VersionStart,
    VersionVerdict,
)

from .completions import Completions
from .dataplane import DataPlane
from .joining import JoinWatch
from .lograte import Throttled
from .membership import Membership as ClusterView
from .names import Refusal
from .peers import COORDINATOR, PeerMesh
from .plans import PlanBook, elastic_engine_node, nodes_of
from .publishing import Publishing
from .ratelimit import HELLO_BURST, HELLO_RATE, Buckets
from .seams import Spawn
from .sessions import Session
from .statusrate import StatusAnswers

log = structlog.get_logger("weightwire.daemon")


class Cluster:
    def __init__(
        self,
        view: ClusterView,
        mesh: PeerMesh,
        member: Callable[[], Member],
        coordinator_endpoint: Callable[[], str],
        heartbeat_timeout_s: float,
        sessions: Mapping[bytes, Session],
        plans: PlanBook,
        publishing: Publishing,
        completions: Completions,
        dataplane: DataPlane,
        spawn: Spawn,
        join: JoinWatch,
        joined: Callable[[str], None],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.view = view
        self.node = view.node
        self._mesh = mesh
        self._member = member
        self._coordinator_endpoint = coordinator_endpoint
        self._timeout_s = heartbeat_timeout_s
        self._sessions = sessions
        self._plans = plans
        self._publishing = publishing
        self._completions = completions
        self._dataplane = dataplane
        self._spawn = spawn
        self.join = join
        self._joined = joined  # told the coordinator's name on the first welcome (READY)
        self._status = StatusAnswers(status)
        self._ready_sent = False
        self._peer_errors = Throttled()  # any allowed key may send them, in a loop
        # hellos to a daemon that does not coordinate: each was answered, in a loop as fast
        # as a member sent them; now at the coordinator's rate per node name
        self._hellos = Buckets(HELLO_RATE, HELLO_BURST)
        self._hellos_dropped = Throttled(10.0)
        self._last_hello = 0.0
        # node -> an incarnation its heartbeats said it restarted as, until the membership
        # says which one it is: its old one is not "back" meanwhile
        self._restarted: dict[str, str] = {}

    # --- periodic: joining, heartbeats, liveness -----------------------------

    def tick(self, now: float) -> None:
        view = self.view
        if view.coordinator is not None:
            self._mesh.last_seen[self.node] = now  # the coordinator is never lost to itself
        if (
            view.coordinator_name is None
            or not self._mesh.alive(view.coordinator_name, self._timeout_s)
        ) and now - self._last_hello >= 1.0:
            if view.coordinator_name is not None:
                self.join.on_left()
            view.coordinator_name = None
            self.join.check(now)
            if self.join.refused_key:  # a fresh socket, so a fresh handshake (after SIGHUP)
                self._mesh.reconnect(COORDINATOR)
                self.join.attach(self._mesh.socket_to(COORDINATOR))
            self._mesh.send_soon(
                COORDINATOR, PeerHello(protocol=PROTOCOL_VERSION, member=self._member())
            )
            self._last_hello = now
        beat = Heartbeat(node=self.node, incarnation=view.incarnation)
        targets = set(self._plans.related_since)
        if view.coordinator is not None:
            targets |= set(view.coordinator.members)
        elif view.coordinator_name is not None:
            targets.add(view.coordinator_name)
        for node in targets - {self.node}:
            self._mesh.send_soon(node, beat)
        if view.coordinator is not None:
            view.coordinator.check_liveness()
        self._check_related(now)

    def _check_related(self, now: float) -> None:
        timeout = self._timeout_s
        for node, since in self._plans.related_since.items():
            if node == self.node or node in self.view.lost:
                continue
            if now - since > timeout and not self._mesh.alive(node, timeout):
                self.node_lost(node, f"no heartbeat from {node} for {timeout:.1f} s")

    def node_lost(self, node: str, reason: str) -> None:
        if node in self.view.lost:
            return
        self.view.lost.add(node)
        log.warning("peer lost", peer=node, reason=reason)
        self._dataplane.disconnect_soon(node, reason)
        self._spawn(self._dataplane.fence((node,), reason))  # nothing of its lands here now
        for rc in self._completions.ranks.values():
            rc.fail_in_progress(ErrorCode.PEER_LOST, reason, source=node)
        for job, plan in list(self._plans.plans.items()):
            if node not in nodes_of(plan):
                continue
            if elastic_engine_node(plan, node):
                # an engine replica's node: only that replica is dropped from the version
                # in flight; the coordinator sends the plan without it
                self._publishing.drop_nodes(job, {node}, reason)
                continue
            self._plans.withdraw(job, f"plan withdrawn: {reason}")

    def node_back(self, node: str) -> None:
        if node in self.view.lost:
            self.view.lost.discard(node)
            log.info("peer back", peer=node)
            for job in {s.job for s in self._sessions.values()}:
                self._plans.advertise(job)

    # --- peer messages -------------------------------------------------------

    async def on_peer(self, sender: str, msg: PeerMessage, key: bytes | None = None) -> None:
        """A message the mesh admitted: `sender` is bound to `key` (see names.py)."""
        coordinator = self.view.coordinator
        if coordinator is not None:
            coordinator.seen(sender)
        match msg:
            case PeerHello():
                if coordinator is None and not self._hellos.take(sender):
                    self._hellos_dropped.emit(
                        log.warning, "hellos dropped", peer=sender, rate_per_s=HELLO_RATE
                    )
                elif coordinator is None:
                    self._mesh.send_soon(
                        sender, PeerError(code="not_coordinator", message=f"{self.node} is not")
                    )
                elif refusal := coordinator.binding_refusal(msg.member, key):
                    self._mesh.refusals.refused(sender, key, "PeerHello", Refusal(refusal))
                else:
                    self._mesh.know(sender, msg.member.endpoint, _key(msg.member.public_key))
                    coordinator.on_hello(sender, msg)
            case PeerWelcome(coordinator=name):
                if self.view.coordinator_name != name:
                    log.info("joined", coordinator=name)
                self.view.coordinator_name = name
                self.join.on_joined()
                if not self._ready_sent:
                    self._ready_sent = True
                    self._joined(name)
                self._mesh.know(
                    name, self._coordinator_endpoint(), self._mesh.security.coordinator_key
                )
                # the coordinator judges every advert afresh (one that restarted knows no
                # refusal of the one before): a refusal it does not repeat is gone
                self._plans.rank_problems.clear()
                for job in {s.job for s in self._sessions.values()} | set(self._plans.plans):
                    self._plans.advertise(job)
            case Membership(members=members, lost=lost):
                self._membership(members, lost)
            case Advertise():
                if coordinator is not None:
                    coordinator.on_advertise(sender, msg)
            case AssignPlan(plan=plan):
                self._plans.install(plan)
            case PlanProblem(job=job, ranks=ranks, cleared=True):
                self._plans.cleared(job, ranks)
            case PlanProblem(job=job, message=message, withdrawn=True):
                self._plans.incomplete(job, message)
            case PlanProblem(job=job, code=code, message=message, ranks=ranks):
                self._plans.problem(job, PlanError(message, code=ErrorCode(code)), ranks)
            case Heartbeat(node=node, incarnation=inc):
                self._heartbeat(node, inc)
            case VersionStart(job=job, version=version, source_node=src):
                for rc in self._completions.of_job(job):
                    if src in rc.expect.sources:
                        rc.on_start(version, src, msg.source_rank)
            case BucketLanded(job=job, source_node=src, parts=parts):
                by_slot = {p.slot: p for p in parts}
                for rc in self._completions.of_job(job):
                    part = by_slot.get(rc.expect.slot)
                    if part is not None and src in rc.expect.sources:
                        rc.on_bucket(msg, part)
            case VersionAbort(job=job, version=version, source_node=src, message=message):
                for rc in self._completions.of_job(job):
                    if src in rc.expect.sources:
                        rc.fail(version, ErrorCode.ABORTED, f"{src}: {message}")
            case VersionVerdict(job=job, version=version, verdict=verdict):
                self._publishing.on_verdict(job, version, verdict)
            case TransportSignal(reply=True):
                self._mesh.resolve(sender, msg.req, msg)
            case TransportSignal(transport=name, payload=payload):
                self._dataplane.answer_signal_soon(sender, msg.req, name, payload)
            case StatusQuery():
                body = self._status.answer(sender)  # None: past its rate, dropped
                if body is not None:
                    self._mesh.send_soon(sender, StatusAnswer(req=msg.req, body=body))
            case StatusAnswer():
                self._mesh.resolve(sender, msg.req, msg)
            case PeerError(code=code, message=message) if self.view.coordinator_name is None:
                self.join.refused(code, message)  # said by JoinWatch, once per interval
            case PeerError(code=code, message=message):
                self._peer_errors.emit(
                    log.warning,
                    "peer reported an error",
                    peer=sender,
                    code=code[:64],
                    error=message[:500],
                )

    def _membership(self, members: tuple[Member, ...], lost: tuple[str, ...]) -> None:
        known = self.view.members
        for m in members:
            old = known.get(m.node)
            known[m.node] = m
            if old is None or old.incarnation != m.incarnation:
                self._restarted.pop(m.node, None)
            # its own endpoint too: a trainer rank here announces its versions to the
            # engine ranks here through the mesh (the coordinator learns its own from its
            # own hello; without this, another daemon dropped them: no version completed)
            self._mesh.know(m.node, m.endpoint, _key(m.public_key))
            if old is not None and old.incarnation != m.incarnation:
                self.node_lost(m.node, f"{m.node} restarted")
                self.node_back(m.node)
        for node in lost:
            known.pop(node, None)
            self._restarted.pop(node, None)
            self.node_lost(node, f"the coordinator lost {node}")

    def _heartbeat(self, node: str, incarnation: str) -> None:
        view = self.view
        if node == view.coordinator_name and incarnation != view.coordinator_incarnation:
            if view.coordinator_incarnation is not None:
                log.info("coordinator restarted; joining again", peer=node)
                view.coordinator_name = None  # the next tick says hello again
            view.coordinator_incarnation = incarnation
        member = view.members.get(node)
        if member is not None and member.incarnation != incarnation:
            self._restarted[node] = incarnation
            self.node_lost(node, f"{node} restarted")
        elif member is None or node not in self._restarted:
            # a heartbeat of the incarnation it restarted from is not its return: a member
            # that sent the two in turn was lost and back at every one (two log lines, a
            # fence, and every job of this node advertised to the coordinator again)
            self.node_back(node)


def _key(text: str) -> bytes | None:
    return text.encode() if text else None
