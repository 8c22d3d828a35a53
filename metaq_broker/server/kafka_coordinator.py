"""Kafka's classic consumer-group protocol as a state machine: JoinGroup, SyncGroup, Heartbeat, LeaveGroup,
session expiry, rebalances, the checks of OffsetCommit, and what DescribeGroups, ListGroups and DeleteGroups
see of the groups in memory. No sockets, no ZooKeeper, no threads: time comes from ``clock`` (seconds), and
what must be written goes to ``persistence`` (``server/kafka_groups.py`` keeps it in ZooKeeper), so every
transition can be driven step by step in a test.

States (Kafka's names, ``GroupState``): Empty -> PreparingRebalance (members join) -> CompletingRebalance
(the leader assigns) -> Stable; any change of members goes back to PreparingRebalance; Dead is a group
given up (deleted, or now coordinated elsewhere).

**Parked requests.** JoinGroup waits for the rebalance and SyncGroup for the leader's assignment, so both
return a ``concurrent.futures.Future`` resolving to the response body (a dict in the codec's field names:
``protocol/kafka/messages.py``). A request answered at once returns a future already done. The listener
attaches ``add_done_callback`` and sends the answer from there: callbacks run on whichever thread
completes the rebalance (another member's request, ``tick``, or a ZooKeeper write's completion), so they
must only hand the answer to the connection, not block. A connection that closes may simply drop its
future; the member then expires like one that stopped heartbeating.

**Time.** ``tick()`` applies every deadline due (sessions, pending member ids, rebalance and sync timeouts,
the initial rebalance delay) and returns the seconds until the next one; a broker calls it from one
thread in a loop (``KafkaGroups``), a test after moving its fake clock.

**Lock order.** ``_lock`` guards all groups. Futures are resolved and ``persistence`` is called only after
it is released: queued as effects, which run in the order queued, one thread at a time (``_effects_lock``,
reentrant, always taken before ``_lock``, never while holding it), so ``persistence`` sees the member sets
in the order they happened and a callback may call back into the coordinator.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from metaq_broker.protocol.kafka import codes
from metaq_broker.zk.kafka_group_records import GroupMovedError, GroupRecord, MemberRecord

log = logging.getLogger(__name__)

EMPTY, PREPARING, COMPLETING, STABLE, DEAD = "Empty", "PreparingRebalance", "CompletingRebalance", "Stable", "Dead"
_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")
IDLE_EMPTY_S = 60.0  # an Empty group without pending member ids is kept in memory this long (any group id
# a client names takes memory: this bounds it by the rate of new names, not their number)


class Persistence:
    """What the coordinator asks to be kept; the default keeps nothing (a test's choice)."""

    def store(self, group_id: str, record: GroupRecord, done: Callable[[Optional[BaseException]], None]) -> None:
        """Write the group's record, then call ``done(None)``, or ``done(error)`` (``GroupMovedError``: another
        broker coordinates it now). May call ``done`` before returning."""
        done(None)

    def members_changed(self, group_id: str, member_ids: tuple) -> None:
        """The group's members are now ``member_ids`` (empty: none, or the group was given up)."""


@dataclass(eq=False)
class Member:
    member_id: str
    instance_id: Optional[str]
    client_id: str
    client_host: str
    session_timeout: float  # seconds
    rebalance_timeout: float
    protocols: list  # [(name, metadata bytes)], the member's order of preference
    assignment: bytes = b""
    join: Optional[Future] = None  # its parked JoinGroup
    sync: Optional[Future] = None  # its parked SyncGroup
    last_heartbeat: float = 0.0
    is_new: bool = False  # joined in the rebalance under way, never had a generation

    def metadata(self, protocol: Optional[str]) -> bytes:
        return next((m for n, m in self.protocols if n == protocol), b"")

    def keep_alive(self, now: float, new_member_timeout: float) -> bool:
        """Kafka's ``shouldKeepAlive``: a member waiting in JoinGroup lives (a new one at most
        ``new_member_timeout``), one waiting in SyncGroup lives, any other until its session times out."""
        if self.join is not None:
            return not self.is_new or self.last_heartbeat + new_member_timeout > now
        return self.sync is not None or self.last_heartbeat + self.session_timeout > now


@dataclass(eq=False)
class Group:
    group_id: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: Optional[str] = None
    protocol: Optional[str] = None
    leader: Optional[str] = None
    members: dict = field(default_factory=dict)  # member id -> Member, in join order
    pending: dict = field(default_factory=dict)  # member ids handed out with MEMBER_ID_REQUIRED -> expiry
    static: dict = field(default_factory=dict)  # group.instance.id -> member id
    join_deadline: float = 0.0  # PreparingRebalance: when the join phase ends at the latest
    initial: bool = False  # in the initial delay of a rebalance that began Empty
    initial_remaining: float = 0.0  # how much longer new members may extend that delay
    new_member_added: bool = False  # a member joined during the current initial delay
    pending_sync: set = field(default_factory=set)  # members that have not sent SyncGroup for this generation
    sync_deadline: float = 0.0
    storing: int = -1  # the generation whose assignment is being written, -1: none
    empty_since: float = 0.0  # when it last became Empty (an idle Empty group is dropped from memory)

    def rebalance_timeout(self) -> float:
        return max((m.rebalance_timeout for m in self.members.values()), default=0.0)

    def all_joined(self) -> bool:
        return not self.pending and all(m.join is not None for m in self.members.values())

    def supports(self, protocol_type: str, names: set, member_id: str) -> bool:
        """Kafka's ``supportsProtocols``: an empty group takes any type; otherwise the type must match and one
        of ``names`` be supported by every other member."""
        others = [m for mid, m in self.members.items() if mid != member_id]
        if not others:
            return bool(protocol_type) and bool(names)
        if protocol_type != self.protocol_type:
            return False
        common = set(names)
        for m in others:
            common &= {n for n, _ in m.protocols}
        return bool(common)

    def select_protocol(self) -> str:
        """The protocol every member supports that most members list first among those (ties: the first
        member's preference)."""
        members = list(self.members.values())
        candidates = set.intersection(*({n for n, _ in m.protocols} for m in members))
        votes: dict = {}
        for m in members:
            choice = next(n for n, _ in m.protocols if n in candidates)
            votes[choice] = votes.get(choice, 0) + 1
        order = [n for n, _ in members[0].protocols if n in candidates]
        return max(order, key=lambda n: (votes.get(n, 0), -order.index(n)))

    def fenced(self, member_id: str, instance_id: Optional[str]) -> bool:
        """A static member's instance id held by another member id: this one was replaced."""
        return instance_id is not None and instance_id in self.static and self.static[instance_id] != member_id


class GroupCoordinator:
    """The groups one broker coordinates. Timeouts in milliseconds as Kafka's broker settings name them:
    ``group.min.session.timeout.ms``, ``group.max.session.timeout.ms``, ``group.initial.rebalance.delay.ms``,
    ``group.max.size``; a new member's JoinGroup waits at most ``new_member_join_timeout_ms``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, persistence: Optional[Persistence] = None, *,
                 min_session_timeout_ms: int = 6000, max_session_timeout_ms: int = 1_800_000,
                 initial_rebalance_delay_ms: int = 3000, max_group_size: int = 2 ** 31 - 1,
                 new_member_join_timeout_ms: int = 300_000):
        self.clock = clock
        self.persistence = persistence or Persistence()
        self.min_session_ms, self.max_session_ms = min_session_timeout_ms, max_session_timeout_ms
        self.initial_delay = initial_rebalance_delay_ms / 1000
        self.max_group_size = max_group_size
        self.new_member_timeout = new_member_join_timeout_ms / 1000
        self.idle_empty = IDLE_EMPTY_S
        self._groups: dict = {}
        self._lock = threading.RLock()
        self._effects: list = []  # run in order after the lock is released (see the module's doc)
        self._effects_lock = threading.RLock()

    # -- effects --------------------------------------------------------------------------------------
    def _after(self, fn, *args) -> None:
        self._effects.append(functools.partial(fn, *args))

    def _resolve(self, fut: Future, body: dict) -> None:
        self._after(_set_result, fut, body)

    def _run_effects(self) -> None:
        with self._effects_lock:
            while True:
                with self._lock:
                    if not self._effects:
                        return
                    effects, self._effects = self._effects, []
                for effect in effects:
                    try:
                        effect()
                    except Exception:  # noqa: BLE001 - one failing callback must not stop the others
                        log.exception("Kafka group coordinator: a callback failed")

    def _members_changed(self, group: Group) -> None:
        self._after(self.persistence.members_changed, group.group_id,
                    tuple(group.members) if group.state != DEAD else ())

    # -- JoinGroup ------------------------------------------------------------------------------------
    def join_group(self, req: dict, version: int, client_id: Optional[str] = "", client_host: str = "") -> Future:
        """A JoinGroup request's body; the future resolves to the JoinGroup response body."""
        fut: Future = Future()
        with self._lock:
            self._join(fut, req, version, client_id or "", client_host)
        self._run_effects()
        return fut

    def _join(self, fut: Future, req: dict, version: int, client_id: str, client_host: str) -> None:
        group_id, member_id = req["group_id"], req["member_id"] or ""
        instance_id = req.get("group_instance_id")
        session_ms = req["session_timeout_ms"]
        rebalance_ms = req.get("rebalance_timeout_ms", -1)
        rebalance_ms = session_ms if rebalance_ms is None or rebalance_ms < 0 else rebalance_ms  # v0: the session's
        protocols = [(p["name"], bytes(p["metadata"])) for p in req["protocols"]]
        protocol_type = req["protocol_type"]

        def fail(code: int, mid: str = member_id) -> None:
            self._resolve(fut, join_error(code, mid))

        if not group_id:
            return fail(codes.INVALID_GROUP_ID)
        if not self.min_session_ms <= session_ms <= self.max_session_ms:
            return fail(codes.INVALID_SESSION_TIMEOUT)
        group = self._groups.get(group_id)
        if group is None:
            if member_id:  # a member of a group this coordinator does not know: it must join anew
                return fail(codes.UNKNOWN_MEMBER_ID)
            group = self._groups[group_id] = Group(group_id, empty_since=self.clock())
        if group.state == DEAD:
            return fail(codes.COORDINATOR_NOT_AVAILABLE)
        if not group.supports(protocol_type, {n for n, _ in protocols}, member_id):
            return fail(codes.INCONSISTENT_GROUP_PROTOCOL)
        now = self.clock()
        spec = dict(instance_id=instance_id, client_id=client_id, client_host=client_host,
                    session_timeout=session_ms / 1000, rebalance_timeout=rebalance_ms / 1000, protocols=protocols)
        if not member_id:
            if instance_id not in group.static and len(group.members) + len(group.pending) >= self.max_group_size:
                return fail(codes.GROUP_MAX_SIZE_REACHED)
            new_id = _member_id(instance_id or client_id)
            if instance_id is not None and instance_id in group.static:
                self._replace_static(group, fut, new_id, spec, now)
            elif instance_id is None and version >= 4:  # KIP-394: the member must come back with this id
                group.pending[new_id] = now + session_ms / 1000
                return fail(codes.MEMBER_ID_REQUIRED, new_id)
            else:
                self._add_member(group, fut, new_id, protocol_type, spec, now)
        elif member_id in group.pending:
            self._add_member(group, fut, member_id, protocol_type, spec, now)
        elif group.fenced(member_id, instance_id):
            return fail(codes.FENCED_INSTANCE_ID)
        elif member_id not in group.members or (instance_id is not None and instance_id not in group.static):
            return fail(codes.UNKNOWN_MEMBER_ID)
        else:
            member = group.members[member_id]
            same = member.protocols == protocols
            if group.state == PREPARING:
                self._update_member(group, member, fut, spec, now)
            elif group.state == COMPLETING and same:  # a repeated JoinGroup (its answer was lost): answer again
                self._resolve(fut, self._join_answer(group, member))
            elif group.state == STABLE and same and member_id != group.leader:
                self._resolve(fut, self._join_answer(group, member))
            elif group.state in (COMPLETING, STABLE):  # new metadata, or the leader asks for a new assignment
                self._update_member(group, member, fut, spec, now)
            else:
                return fail(codes.UNKNOWN_MEMBER_ID)
        if group.state == PREPARING:
            self._maybe_complete_join(group)

    def _add_member(self, group: Group, fut: Future, member_id: str, protocol_type: str, spec: dict,
                    now: float) -> None:
        if not group.members:
            group.protocol_type = protocol_type
        member = Member(member_id, **spec, join=fut, last_heartbeat=now, is_new=True)
        if group.state == PREPARING and group.initial:
            group.new_member_added = True
        group.members[member_id] = member
        group.pending.pop(member_id, None)
        if member.instance_id is not None:
            group.static[member.instance_id] = member_id
        if group.leader is None:
            group.leader = member_id
        self._members_changed(group)
        self._maybe_prepare_rebalance(group, f"member {member_id} joined")

    def _update_member(self, group: Group, member: Member, fut: Future, spec: dict, now: float) -> None:
        if member.join is not None and member.join is not fut:
            self._resolve(member.join, join_error(codes.REBALANCE_IN_PROGRESS, member.member_id))
        member.protocols = spec["protocols"]
        member.session_timeout, member.rebalance_timeout = spec["session_timeout"], spec["rebalance_timeout"]
        member.client_id, member.client_host = spec["client_id"], spec["client_host"]
        member.join, member.last_heartbeat = fut, now
        self._maybe_prepare_rebalance(group, f"member {member.member_id} rejoined")

    def _replace_static(self, group: Group, fut: Future, new_id: str, spec: dict, now: float) -> None:
        """A static member (``group.instance.id``) restarted: its new member id takes the old one's place,
        requests under the old id are fenced (FENCED_INSTANCE_ID), and a stable group does not rebalance."""
        old_id = group.static[spec["instance_id"]]
        member = group.members.pop(old_id)
        if member.join is not None:
            self._resolve(member.join, join_error(codes.FENCED_INSTANCE_ID, old_id))
        if member.sync is not None:
            self._resolve(member.sync, sync_answer(codes.FENCED_INSTANCE_ID))
        member.join = member.sync = None
        old_leader = group.leader
        member.member_id = new_id
        group.members[new_id] = member
        group.static[spec["instance_id"]] = new_id
        if group.leader == old_id:
            group.leader = new_id
        if old_id in group.pending_sync:
            group.pending_sync.discard(old_id)
            group.pending_sync.add(new_id)
        same = member.protocols == spec["protocols"]
        member.client_id, member.client_host = spec["client_id"], spec["client_host"]
        member.session_timeout, member.rebalance_timeout = spec["session_timeout"], spec["rebalance_timeout"]
        member.last_heartbeat = now
        self._members_changed(group)
        if group.state in (STABLE, COMPLETING) and same:
            # the old leader id is answered, so the new member does not take itself for the leader and assign
            self._resolve(fut, {**self._join_answer(group, member), "leader": old_leader or "",
                                "members": []})
            self._after(self._store_quietly, group.group_id, self._record(group))
        else:
            member.protocols = spec["protocols"]
            member.join = fut
            self._maybe_prepare_rebalance(group, f"static member {spec['instance_id']} rejoined")

    def _join_answer(self, group: Group, member: Member) -> dict:
        leader = member.member_id == group.leader
        return {"throttle_time_ms": 0, "error_code": codes.NONE, "generation_id": group.generation,
                "protocol_type": group.protocol_type, "protocol_name": group.protocol or "",
                "leader": group.leader or "", "skip_assignment": False, "member_id": member.member_id,
                "members": [{"member_id": m.member_id, "group_instance_id": m.instance_id,
                             "metadata": m.metadata(group.protocol)} for m in group.members.values()] if leader else []}

    # -- rebalancing ----------------------------------------------------------------------------------
    def _maybe_prepare_rebalance(self, group: Group, reason: str) -> None:
        if group.state in (EMPTY, STABLE, COMPLETING):
            self._prepare_rebalance(group, reason)

    def _prepare_rebalance(self, group: Group, reason: str) -> None:
        if group.state == COMPLETING:  # members waiting for an assignment must rejoin
            self._reset_assignments(group, codes.REBALANCE_IN_PROGRESS)
        now = self.clock()
        group.pending_sync.clear()
        group.storing = -1
        if group.state == EMPTY and self.initial_delay > 0:  # let more of a starting group's members arrive
            group.initial, group.new_member_added = True, False
            group.initial_remaining = max(group.rebalance_timeout() - self.initial_delay, 0.0)
            group.join_deadline = now + self.initial_delay
        else:
            group.initial = False
            group.join_deadline = now + group.rebalance_timeout()
        log.info("group %s: preparing a rebalance from generation %d (%s)", group.group_id, group.generation, reason)
        group.state = PREPARING
        self._maybe_complete_join(group)

    def _maybe_complete_join(self, group: Group) -> None:
        if group.state == PREPARING and not group.initial and group.all_joined():
            self._complete_join(group)

    def _complete_join(self, group: Group) -> None:
        now = self.clock()
        for m in [m for m in group.members.values() if m.join is None and m.instance_id is None]:
            self._drop_member(group, m)  # did not rejoin in time (static members keep their place)
        joined = [m for m in group.members.values() if m.join is not None]
        if group.members and not joined:  # only static members that have not rejoined: wait for their sessions
            group.join_deadline = now + group.rebalance_timeout()
            return
        group.generation += 1
        if not group.members:
            group.state, group.protocol, group.leader, group.empty_since = EMPTY, None, None, now
            log.info("group %s is empty at generation %d", group.group_id, group.generation)
            self._members_changed(group)
            self._after(self._store_quietly, group.group_id, self._record(group))
            return
        if group.leader not in {m.member_id for m in joined}:
            group.leader = joined[0].member_id
        group.protocol = group.select_protocol()
        group.state = COMPLETING
        group.pending_sync = set(group.members)
        group.sync_deadline = now + group.rebalance_timeout()
        log.info("group %s: generation %d with %d members, protocol %s, leader %s", group.group_id,
                 group.generation, len(group.members), group.protocol, group.leader)
        for m in group.members.values():
            if m.join is not None:
                self._resolve(m.join, self._join_answer(group, m))
                m.join = None
            m.last_heartbeat, m.is_new = now, False
        self._members_changed(group)

    def _reset_assignments(self, group: Group, code: int) -> None:
        for m in group.members.values():
            m.assignment = b""
            if m.sync is not None:
                self._resolve(m.sync, sync_answer(code))
                m.sync = None

    # -- SyncGroup ------------------------------------------------------------------------------------
    def sync_group(self, req: dict) -> Future:
        """A SyncGroup request's body; the future resolves to the SyncGroup response body."""
        fut: Future = Future()
        with self._lock:
            code = self._sync(fut, req)
            if code is not None:
                self._resolve(fut, sync_answer(code))
        self._run_effects()
        return fut

    @staticmethod
    def _member_error(group, req: dict) -> Optional[int]:
        """The error for a SyncGroup or Heartbeat whose member is not one of ``group``'s current generation
        (checked in Kafka's order), else None."""
        member_id, instance_id = req["member_id"], req.get("group_instance_id")
        if group is None:
            return codes.UNKNOWN_MEMBER_ID
        if group.state == DEAD:
            return codes.COORDINATOR_NOT_AVAILABLE
        if group.fenced(member_id, instance_id):
            return codes.FENCED_INSTANCE_ID
        if member_id not in group.members:
            return codes.UNKNOWN_MEMBER_ID
        if req["generation_id"] != group.generation:
            return codes.ILLEGAL_GENERATION
        return None

    def _sync(self, fut: Future, req: dict) -> Optional[int]:
        group = self._groups.get(req["group_id"])
        refused = self._member_error(group, req)
        if refused is not None:
            return refused
        member_id = req["member_id"]
        if (req.get("protocol_type") is not None and req["protocol_type"] != group.protocol_type) or \
                (req.get("protocol_name") is not None and req["protocol_name"] != group.protocol):
            return codes.INCONSISTENT_GROUP_PROTOCOL
        if group.state == EMPTY:
            return codes.UNKNOWN_MEMBER_ID
        if group.state == PREPARING:
            return codes.REBALANCE_IN_PROGRESS
        member = group.members[member_id]
        member.last_heartbeat = self.clock()
        group.pending_sync.discard(member_id)
        if group.state == STABLE:
            self._resolve(fut, {**sync_answer(codes.NONE), "protocol_type": group.protocol_type,
                                "protocol_name": group.protocol, "assignment": member.assignment})
            return None
        if member.sync is not None and member.sync is not fut:
            self._resolve(member.sync, sync_answer(codes.REBALANCE_IN_PROGRESS))
        member.sync = fut
        if member_id == group.leader and group.storing != group.generation:
            given = {a["member_id"]: bytes(a["assignment"]) for a in req["assignments"]}
            assignment = {mid: given.get(mid, b"") for mid in group.members}
            group.storing = generation = group.generation
            log.info("group %s: assignment for generation %d received from leader %s", group.group_id,
                     generation, member_id)
            done = functools.partial(self._stored, group.group_id, generation, assignment)
            self._after(self.persistence.store, group.group_id, self._record(group, assignment), done)
        return None

    def _stored(self, group_id: str, generation: int, assignment: dict, error: Optional[BaseException]) -> None:
        """The leader's assignment was written (or failed to be): hand it out, or make the members rejoin."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is None or group.state != COMPLETING or group.generation != generation:
                return  # the group moved on meanwhile
            group.storing = -1
            if isinstance(error, GroupMovedError):
                log.warning("group %s: %s; giving the group up", group_id, error)
                self._unload_group(group)
            elif error is not None:
                log.warning("group %s: the assignment of generation %d could not be stored (%s); rebalancing",
                            group_id, generation, error)
                self._reset_assignments(group, codes.COORDINATOR_NOT_AVAILABLE)
                self._maybe_prepare_rebalance(group, "the assignment could not be stored")
            else:
                now = self.clock()
                group.state = STABLE
                for m in group.members.values():
                    m.assignment = assignment.get(m.member_id, b"")
                    if m.sync is not None:
                        self._resolve(m.sync, {**sync_answer(codes.NONE), "protocol_type": group.protocol_type,
                                               "protocol_name": group.protocol, "assignment": m.assignment})
                        m.sync, m.last_heartbeat = None, now
        self._run_effects()

    def _store_quietly(self, group_id: str, record: GroupRecord) -> None:
        """Store a record nothing waits for (an emptied group, a static member's new id)."""
        def done(error):
            if isinstance(error, GroupMovedError):
                with self._lock:
                    group = self._groups.get(group_id)
                    if group is not None:
                        log.warning("group %s: %s; giving the group up", group_id, error)
                        self._unload_group(group)
                self._run_effects()
            elif error is not None:
                log.warning("group %s: its record could not be stored: %s", group_id, error)
        self.persistence.store(group_id, record, done)

    def _record(self, group: Group, assignment: Optional[dict] = None) -> GroupRecord:
        members = tuple(MemberRecord(m.member_id, m.instance_id, m.client_id, m.client_host,
                                     int(m.session_timeout * 1000), int(m.rebalance_timeout * 1000),
                                     m.metadata(group.protocol),
                                     (assignment or {}).get(m.member_id, m.assignment))
                        for m in group.members.values())
        return GroupRecord(group.generation, group.protocol_type, group.protocol, group.leader, members)

    # -- Heartbeat, LeaveGroup, expiry ----------------------------------------------------------------
    def heartbeat(self, req: dict) -> dict:
        """A Heartbeat request's body -> the response body."""
        with self._lock:
            code = self._heartbeat(req)
        self._run_effects()
        return {"throttle_time_ms": 0, "error_code": code}

    def _heartbeat(self, req: dict) -> int:
        group = self._groups.get(req["group_id"])
        refused = self._member_error(group, req)
        if refused is not None:
            return refused
        member_id = req["member_id"]
        if group.state == EMPTY:
            return codes.UNKNOWN_MEMBER_ID
        group.members[member_id].last_heartbeat = self.clock()
        return codes.REBALANCE_IN_PROGRESS if group.state == PREPARING else codes.NONE

    def leave_group(self, req: dict, version: int) -> dict:
        """A LeaveGroup request's body -> the response body (v0-2: one member, its error at the top)."""
        leaving = req["members"] if version >= 3 else [{"member_id": req["member_id"], "group_instance_id": None}]
        with self._lock:
            top, results = self._leave(req["group_id"], leaving)
        self._run_effects()
        if version < 3:
            return {"throttle_time_ms": 0, "error_code": top or results[0]["error_code"]}
        return {"throttle_time_ms": 0, "error_code": top, "members": results}

    def _leave(self, group_id: str, leaving: list) -> tuple:
        group = self._groups.get(group_id)
        results = []

        def result(who: dict, code: int) -> None:
            results.append({"member_id": who["member_id"], "group_instance_id": who.get("group_instance_id"),
                            "error_code": code})

        if group is not None and group.state == DEAD:
            return codes.COORDINATOR_NOT_AVAILABLE, []
        for who in leaving:
            member_id, instance_id = who["member_id"] or "", who.get("group_instance_id")
            if group is None:
                result(who, codes.UNKNOWN_MEMBER_ID)
            elif member_id and group.fenced(member_id, instance_id):
                result(who, codes.FENCED_INSTANCE_ID)
            elif member_id in group.pending:
                del group.pending[member_id]
                self._maybe_complete_join(group)
                result(who, codes.NONE)
            elif instance_id is not None and instance_id in group.static:
                self._remove_member(group, group.members[group.static[instance_id]], "left")
                result(who, codes.NONE)
            elif member_id in group.members:
                self._remove_member(group, group.members[member_id], "left")
                result(who, codes.NONE)
            else:
                result(who, codes.UNKNOWN_MEMBER_ID)
        return codes.NONE, results

    def _drop_member(self, group: Group, member: Member) -> None:
        """Take ``member`` out, answering what it has parked; the group's state is the caller's."""
        if member.join is not None:
            self._resolve(member.join, join_error(codes.UNKNOWN_MEMBER_ID, ""))
        if member.sync is not None:
            self._resolve(member.sync, sync_answer(codes.UNKNOWN_MEMBER_ID))
        member.join = member.sync = None
        del group.members[member.member_id]
        if member.instance_id is not None and group.static.get(member.instance_id) == member.member_id:
            del group.static[member.instance_id]
        group.pending_sync.discard(member.member_id)
        if group.leader == member.member_id:
            group.leader = next(iter(group.members), None)
        self._members_changed(group)

    def _remove_member(self, group: Group, member: Member, why: str) -> None:
        log.info("group %s: member %s %s", group.group_id, member.member_id, why)
        self._drop_member(group, member)
        if group.state in (STABLE, COMPLETING):
            self._maybe_prepare_rebalance(group, f"member {member.member_id} {why}")
        elif group.state == PREPARING:
            self._maybe_complete_join(group)

    def tick(self) -> float:
        """Apply every deadline due now; the seconds until the next one (at most 1)."""
        with self._lock:
            now = self.clock()
            for group in list(self._groups.values()):
                self._tick_group(group, now)
            wait = min([d for g in self._groups.values() for d in self._deadlines(g)], default=now + 1.0) - now
        self._run_effects()
        return min(max(wait, 0.0), 1.0)

    def _tick_group(self, group: Group, now: float) -> None:
        if group.state == EMPTY and not group.members and not group.pending and \
                now - group.empty_since > self.idle_empty:  # its record has what it is: loaded again if asked
            del self._groups[group.group_id]
            return
        for member_id, expiry in list(group.pending.items()):
            if expiry <= now:
                del group.pending[member_id]
                self._maybe_complete_join(group)
        for m in list(group.members.values()):
            if m.member_id in group.members and not m.keep_alive(now, self.new_member_timeout):
                self._remove_member(group, m, "timed out (no heartbeat within its session timeout)")
        if group.state == PREPARING and group.join_deadline <= now:
            if group.initial and group.new_member_added and group.initial_remaining > 0:
                delay = min(self.initial_delay, group.initial_remaining)
                group.initial_remaining = max(group.initial_remaining - self.initial_delay, 0.0)
                group.new_member_added, group.join_deadline = False, now + delay
            else:
                group.initial = False
                self._complete_join(group)
        if group.state in (COMPLETING, STABLE) and group.pending_sync and group.sync_deadline <= now:
            for member_id in list(group.pending_sync):
                if member_id in group.members:
                    self._remove_member(group, group.members[member_id], "sent no SyncGroup within the rebalance timeout")

    def _deadlines(self, group: Group) -> list:
        out = list(group.pending.values())
        for m in group.members.values():
            if m.join is not None:
                if m.is_new:
                    out.append(m.last_heartbeat + self.new_member_timeout)
            elif m.sync is None:
                out.append(m.last_heartbeat + m.session_timeout)
        if group.state == PREPARING:
            out.append(group.join_deadline)
        if group.pending_sync:
            out.append(group.sync_deadline)
        return out

    # -- OffsetCommit's checks ------------------------------------------------------------------------
    def commit_allowed(self, group_id: str, generation: int, member_id: str, instance_id: Optional[str]) -> int:
        """The error of an OffsetCommit before anything is written (NONE: write it). A commit with generation
        -1 and no member id is a client keeping offsets without group management: allowed while the group
        has no members. A member's commit counts as its heartbeat."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                return codes.NONE if generation < 0 else codes.ILLEGAL_GENERATION
            if group.state == DEAD:
                return codes.COORDINATOR_NOT_AVAILABLE
            if group.fenced(member_id, instance_id):
                return codes.FENCED_INSTANCE_ID
            if generation < 0 and group.state == EMPTY:
                return codes.NONE
            if member_id not in group.members:
                return codes.UNKNOWN_MEMBER_ID
            if generation != group.generation:
                return codes.ILLEGAL_GENERATION
            if group.state == COMPLETING:
                return codes.REBALANCE_IN_PROGRESS
            group.members[member_id].last_heartbeat = self.clock()
            return codes.NONE

    # -- the groups in memory -------------------------------------------------------------------------
    def has(self, group_id: str) -> bool:
        with self._lock:
            return group_id in self._groups

    def member_ids(self, group_id: str) -> tuple:
        with self._lock:
            group = self._groups.get(group_id)
            return tuple(group.members) + tuple(group.pending) if group is not None else ()

    def state(self, group_id: str) -> Optional[str]:
        with self._lock:
            group = self._groups.get(group_id)
            return None if group is None else group.state

    def describe(self, group_id: str) -> Optional[dict]:
        """The DescribeGroups entry of a group in memory (None: not here). Metadata and assignments are
        described only while the group is Stable, as Kafka does."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                return None
            stable = group.state == STABLE
            return {"error_code": codes.NONE, "error_message": None, "group_id": group_id, "group_state": group.state,
                    "protocol_type": group.protocol_type or "", "protocol_data": (group.protocol or "") if stable else "",
                    "members": [{"member_id": m.member_id, "group_instance_id": m.instance_id, "client_id": m.client_id,
                                 "client_host": m.client_host,
                                 "member_metadata": m.metadata(group.protocol) if stable else b"",
                                 "member_assignment": m.assignment if stable else b""}
                                for m in group.members.values()]}

    def overview(self) -> list:
        """[(group id, protocol type, state)] of the groups in memory."""
        with self._lock:
            return [(g.group_id, g.protocol_type or "", g.state) for g in self._groups.values() if g.state != DEAD]

    def delete(self, group_id: str) -> Optional[int]:
        """DeleteGroups for a group in memory: NONE (given up here: the caller removes what is stored),
        NON_EMPTY_GROUP while it has members; None for a group not in memory."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                return None
            if group.members or group.pending:
                return codes.NON_EMPTY_GROUP
            group.state = DEAD
            del self._groups[group_id]
        self._run_effects()
        return codes.NONE

    def load(self, group_id: str, record: Optional[GroupRecord]) -> None:
        """Take over a group from its stored record (another coordinator's, or this broker's before a
        restart): Stable with the record's members, generation and assignments, each member's session
        starting now; Empty without members. A group already in memory is left as it is."""
        with self._lock:
            if group_id in self._groups:
                return
            group = self._groups[group_id] = Group(group_id, empty_since=self.clock())
            if record is not None:
                now = self.clock()
                group.generation, group.protocol_type = record.generation, record.protocol_type
                for r in record.members:
                    group.members[r.member_id] = Member(
                        r.member_id, r.instance_id, r.client_id, r.client_host, r.session_timeout_ms / 1000,
                        r.rebalance_timeout_ms / 1000, [(record.protocol, r.metadata)] if record.protocol else [],
                        r.assignment, last_heartbeat=now)
                    if r.instance_id is not None:
                        group.static[r.instance_id] = r.member_id
                if group.members and record.protocol:
                    group.state, group.protocol = STABLE, record.protocol
                    group.leader = record.leader if record.leader in group.members else next(iter(group.members))
                else:
                    group.members.clear()
                    group.static.clear()
                log.info("group %s loaded: %s, generation %d, %d members", group_id, group.state, group.generation,
                         len(group.members))
                self._members_changed(group)
        self._run_effects()

    def unload(self, keep: Callable[[str], bool]) -> list:
        """Give up every group for which ``keep(group id)`` is false (coordinated elsewhere now): parked
        requests are answered NOT_COORDINATOR, so the members find the new coordinator. Returns their ids."""
        with self._lock:
            gone = [g for gid, g in self._groups.items() if not keep(gid)]
            for group in gone:
                self._unload_group(group)
        self._run_effects()
        return [g.group_id for g in gone]

    def _unload_group(self, group: Group) -> None:
        for m in group.members.values():
            if m.join is not None:
                self._resolve(m.join, join_error(codes.NOT_COORDINATOR, m.member_id))
            if m.sync is not None:
                self._resolve(m.sync, sync_answer(codes.NOT_COORDINATOR))
            m.join = m.sync = None
        group.state = DEAD
        self._groups.pop(group.group_id, None)
        self._members_changed(group)


def _member_id(prefix: str) -> str:
    """Kafka's ``<client id or group.instance.id>-<UUID>``, limited to characters any path and log can hold."""
    return f"{_ID_CHARS.sub('_', prefix or '')[:100] or 'member'}-{uuid.uuid4()}"


def join_error(code: int, member_id: str) -> dict:
    """A JoinGroup answer with an error (protocol name "": a null cannot be sent below v7)."""
    return {"throttle_time_ms": 0, "error_code": code, "generation_id": -1, "protocol_type": None,
            "protocol_name": "", "leader": "", "skip_assignment": False, "member_id": member_id, "members": []}


def sync_answer(code: int) -> dict:
    return {"throttle_time_ms": 0, "error_code": code, "protocol_type": None, "protocol_name": None,
            "assignment": b""}


def _set_result(fut: Future, body: dict) -> None:
    if not fut.done():
        fut.set_result(body)
