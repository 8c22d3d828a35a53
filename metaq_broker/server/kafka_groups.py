"""The consumer-group APIs of a broker's Kafka listener: FindCoordinator, JoinGroup, SyncGroup, Heartbeat,
LeaveGroup, OffsetCommit, OffsetFetch, ListGroups, DescribeGroups, DeleteGroups. Each method takes a decoded
request body and its version (``protocol/kafka/protocol.py``'s ``Request``) and returns the response body, or
for JoinGroup and SyncGroup a ``Future`` of it (``server/kafka_coordinator.py``, "Parked requests").
``allows(operation, resource type, name)`` is the caller's ACL check (``BrokerAuth.allows`` with the
connection's principal), as Kafka checks: Read on the group to take part and to commit (and Read on each
topic committed), Describe on the group to fetch offsets (Describe on each topic) and to describe it,
Delete to delete it, Describe on the cluster to list every group (else those it may Describe).

What it adds to the state machine: whether this broker coordinates a group (``kafka_metadata.coordinator_of``
over the live Kafka brokers; groups that move elsewhere are given up: ``cluster_changed``), the group's
record loaded from ZooKeeper on first use and written after each assignment (``zk/kafka_group_records.py``),
ephemeral member nodes so that ``metaq groups`` and the console see Kafka members, and committed offsets
kept where metaq keeps every group's (``zk/group_offsets.py``) under metaq's partition names, translated
from Kafka's numbers (``zk/kafka_partitions.py``): ``metaq groups``, the lag metrics and the console show
Kafka groups like any other. One thread writes ZooKeeper in order and applies the coordinator's deadlines.

A group that metaq's own consumers use (members without the Kafka mark) is refused to Kafka members
(INCONSISTENT_GROUP_PROTOCOL): the two would read the same partitions. An OffsetCommit's metadata string is
not kept (OffsetFetch answers ""), and offsets commit atomically per topic, not per request.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from kazoo.exceptions import KazooException

from metaq_broker.protocol.kafka import codes
from metaq_broker.security.acl import CLUSTER
from metaq_broker.server import kafka_metadata
from metaq_broker.server.kafka_coordinator import (EMPTY, GroupCoordinator, Persistence, join_error,
                                                    sync_answer)
from metaq_broker.zk import kafka_group_records as zk_groups
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.kafka_cluster import ClusterSnapshot
from metaq_broker.zk.kafka_group_records import GroupMovedError
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

MAX_METADATA = 4096  # bytes of an OffsetCommit's metadata string (Kafka's offset.metadata.max.bytes)
CLASSIC = "classic"  # ListGroups v5's group type: every group here uses the classic protocol


def allow_all(operation: str, resource_type: str, name: str) -> bool:
    return True


def _done(body: dict) -> Future:
    fut: Future = Future()
    fut.set_result(body)
    return fut


class KafkaGroups(Persistence):
    """``zk()`` returns the broker's connected ZooKeeper client or None while it has none; ``cluster()`` the
    current ``ClusterSnapshot`` (``KafkaClusterCache.snapshot``). ``start()`` before use, ``close()`` at
    shutdown; call ``cluster_changed()`` whenever the snapshot changes (``KafkaClusterCache.on_change``).
    Coordinator options (Kafka's ``group.*`` broker settings) pass through ``options``."""

    def __init__(self, zk: Callable, root: str, broker_id: int, cluster: Callable[[], ClusterSnapshot],
                 clock: Callable[[], float] = time.monotonic, coordinating: Callable[[], bool] = lambda: True,
                 **options):
        self._zk, self._cluster, self.broker_id = zk, cluster, broker_id
        self._coordinating = coordinating  # this member is its group's master: a replica coordinates nothing
        self.root, self.paths = root, ZkPaths(root)
        self.coordinator = GroupCoordinator(clock, self, **options)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _versions, _wanted, _published, _dirty, _session
        self._versions: dict = {}  # group -> version of its record node as last read or written (None: none)
        self._wanted: dict = {}  # group -> member ids that should have a node
        self._published: dict = {}  # group -> member ids whose node this session made
        self._dirty: set = set()  # groups whose member nodes differ from _wanted
        self._session = None  # the ZooKeeper session _published belongs to
        self._brokers: frozenset = frozenset()  # the live Kafka brokers cluster_changed last saw
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "KafkaGroups":
        self._thread = threading.Thread(target=self._loop, name="metaq-kafka-groups", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Give every group up (parked requests answered NOT_COORDINATOR), remove the member nodes while
        ZooKeeper answers, stop; returns within about ``timeout``."""
        self.coordinator.unload(lambda group: False)
        self._stop.set()
        self._jobs.put(None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._jobs.empty():
            self._run_job(self._jobs.get_nowait())
        if time.monotonic() < deadline:
            self._sync_member_nodes()

    def cluster_changed(self) -> None:
        """The live brokers may have changed: give up the groups another broker coordinates now."""
        brokers = frozenset(self._cluster().brokers)
        if brokers == self._brokers:
            return  # a topic or epoch changed: no group moves
        self._brokers = brokers
        for group in self.coordinator.unload(self.is_coordinator):
            log.info("group %s is coordinated by another broker now; given up", group)
            with self._lock:
                self._versions.pop(group, None)

    def is_coordinator(self, group: str) -> bool:
        return kafka_metadata.coordinator_of(group, self._cluster().brokers) == self.broker_id \
            and self._coordinating()

    # -- Persistence (called by the coordinator; done on this object's thread) -----------------------
    def store(self, group_id, record, done) -> None:
        self._jobs.put((group_id, record, done))

    def members_changed(self, group_id, member_ids) -> None:
        with self._lock:
            self._wanted[group_id] = set(member_ids)
            self._dirty.add(group_id)
        self._jobs.put(None)  # wake the thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.coordinator.tick()
                try:
                    job = self._jobs.get(timeout=max(wait, 0.01))
                except queue.Empty:
                    job = None
                self._run_job(job)
                self._sync_member_nodes()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                log.exception("Kafka group coordination: an iteration failed")
                self._stop.wait(0.5)

    def _run_job(self, job) -> None:
        if job is None:
            return
        group, record, done = job
        zk = self._zk()
        if zk is None:
            return done(ConnectionError("no ZooKeeper session"))
        with self._lock:
            version = self._versions.get(group)
        try:
            written = zk_groups.write(zk, self.paths, group, record, version)
        except GroupMovedError as e:
            with self._lock:
                self._versions.pop(group, None)
            return done(e)
        except KazooException as e:
            return done(e)
        with self._lock:
            self._versions[group] = written
        done(None)

    def _sync_member_nodes(self) -> None:
        """Make the ephemeral member nodes match the coordinator's members (all again after a new session)."""
        zk = self._zk()
        if zk is None:
            return
        with self._lock:
            if self._session != zk.client_id:
                self._session, self._published = zk.client_id, {}
                self._dirty |= set(self._wanted)
            dirty, self._dirty = self._dirty, set()
            work = [(g, set(self._wanted.get(g, ())), set(self._published.get(g, ()))) for g in dirty]
        for group, wanted, published in work:
            try:
                for member in sorted(wanted - published):
                    zk_groups.add_member(zk, self.paths, group, member, self.broker_id)
                    published.add(member)
                for member in sorted(published - wanted):
                    zk_groups.remove_member(zk, self.paths, group, member)
                    published.discard(member)
            except (KazooException, ValueError) as e:
                log.warning("group %s: member nodes not in step with ZooKeeper yet: %s", group, e)
                with self._lock:
                    self._dirty.add(group)
            with self._lock:
                self._published[group] = published
                if not wanted and not published:
                    self._wanted.pop(group, None)
                    self._published.pop(group, None)

    # -- whose group, loaded from ZooKeeper ----------------------------------------------------------
    def _ensure(self, group: str) -> Optional[int]:
        """None when this broker coordinates ``group`` and has its state (loaded from its record now if it
        was not in memory), else the error to answer."""
        try:
            self.paths.group(group)
        except ValueError:
            return codes.INVALID_GROUP_ID
        if not self.is_coordinator(group):
            if self.coordinator.has(group):  # coordinated elsewhere now, or this member is no longer master:
                self.coordinator.unload(self.is_coordinator)  # its state in memory may be stale when it is again
            return codes.NOT_COORDINATOR
        if self.coordinator.has(group):
            return None
        zk = self._zk()
        if zk is None:
            return codes.COORDINATOR_NOT_AVAILABLE
        try:
            try:
                record, version = zk_groups.read(zk, self.paths, group)
            except ValueError as e:
                stat = zk.exists(self.paths.group_kafka(group))
                record, version = None, None if stat is None else stat.version
                log.warning("group %s: %s; starting the group afresh (the record is replaced at its next write)",
                            group, e)
        except KazooException:
            return codes.COORDINATOR_NOT_AVAILABLE
        with self._lock:
            self._versions[group] = version
        if record is not None:
            self.coordinator.load(group, record)
        return None

    def _store(self) -> Optional[GroupStore]:
        zk = self._zk()
        return None if zk is None else GroupStore(zk, self.root)

    # -- FindCoordinator ------------------------------------------------------------------------------
    def find_coordinator(self, req: dict, version: int, allows=allow_all) -> dict:
        keys = req["coordinator_keys"] if version >= 4 else [req["key"]]
        refused = {k for k in keys if not allows("Describe", "group", k)}
        return kafka_metadata.find_coordinator_response(self._cluster(), req, version, refused)

    # -- membership -----------------------------------------------------------------------------------
    def join_group(self, req: dict, version: int, client_id: Optional[str], client_host: str,
                   allows=allow_all) -> Future:
        group = req["group_id"]
        if not allows("Read", "group", group):
            return _done(join_error(codes.GROUP_AUTHORIZATION_FAILED, req["member_id"]))
        code = self._ensure(group)
        if code is None:
            code = self._refuse_shared(group)
        if code is not None:
            return _done(join_error(code, req["member_id"]))
        return self.coordinator.join_group(req, version, client_id, client_host)

    def _refuse_shared(self, group: str) -> Optional[int]:
        zk = self._zk()
        if zk is None:
            return codes.COORDINATOR_NOT_AVAILABLE
        try:
            native = zk_groups.native_members(zk, self.paths, group)
        except KazooException:
            return codes.COORDINATOR_NOT_AVAILABLE
        if native:
            log.warning("group %s: refused a Kafka member: metaq consumers (%s) use the group; give the Kafka "
                        "consumers another group.id", group, ", ".join(native[:5]))
            return codes.INCONSISTENT_GROUP_PROTOCOL
        return None

    def sync_group(self, req: dict, version: int, allows=allow_all) -> Future:
        code = self._check(req["group_id"], "Read", allows)
        return _done(sync_answer(code)) if code is not None else self.coordinator.sync_group(req)

    def heartbeat(self, req: dict, version: int, allows=allow_all) -> dict:
        code = self._check(req["group_id"], "Read", allows)
        return {"throttle_time_ms": 0, "error_code": code} if code is not None else self.coordinator.heartbeat(req)

    def leave_group(self, req: dict, version: int, allows=allow_all) -> dict:
        code = self._check(req["group_id"], "Read", allows)
        if code is not None:
            return {"throttle_time_ms": 0, "error_code": code, "members": []}
        return self.coordinator.leave_group(req, version)

    def _check(self, group: str, operation: str, allows) -> Optional[int]:
        if not allows(operation, "group", group):
            return codes.GROUP_AUTHORIZATION_FAILED
        return self._ensure(group)

    # -- offsets --------------------------------------------------------------------------------------
    def offset_commit(self, req: dict, version: int, allows=allow_all) -> dict:
        group, snap = req["group_id"], self._cluster()
        code = self._check(group, "Read", allows)
        if code is None:
            code = self.coordinator.commit_allowed(group, req.get("generation_id_or_member_epoch", -1),
                                                   req.get("member_id", ""), req.get("group_instance_id"))
        store = self._store() if code == codes.NONE else None
        if code == codes.NONE and store is None:
            code = codes.COORDINATOR_NOT_AVAILABLE
        topics = []
        for t in req["topics"]:
            name = t["name"] if version < 10 else snap.topic_by_id(t["topic_id"])
            parts = {p["partition_index"]: p for p in t["partitions"]}
            errors = dict.fromkeys(parts, code)
            if code == codes.NONE:
                errors = self._commit_topic(store, group, name, parts, snap, allows,
                                            codes.UNKNOWN_TOPIC_ID if version >= 10 else codes.UNKNOWN_TOPIC_OR_PARTITION)
            topics.append({"name": name or "", "topic_id": t.get("topic_id", bytes(16)),
                           "partitions": [{"partition_index": k, "error_code": e} for k, e in errors.items()]})
        return {"throttle_time_ms": 0, "topics": topics}

    def _commit_topic(self, store: GroupStore, group: str, topic: Optional[str], parts: dict,
                      snap: ClusterSnapshot, allows, unknown: int) -> dict:
        """{partition number: error} of one topic's commit, written in one ZooKeeper transaction."""
        if topic is None:
            return dict.fromkeys(parts, unknown)
        if not allows("Read", "topic", topic):
            return dict.fromkeys(parts, codes.TOPIC_AUTHORIZATION_FAILED)
        tmap = snap.maps.get(topic)
        errors, offsets = {}, {}
        for k, p in parts.items():
            name = tmap.name_of(k) if tmap is not None else None
            if name is None:
                errors[k] = codes.UNKNOWN_TOPIC_OR_PARTITION
            elif len((p.get("committed_metadata") or "").encode()) > MAX_METADATA:
                errors[k] = codes.OFFSET_METADATA_TOO_LARGE
            elif p["committed_offset"] < 0:
                errors[k] = codes.INVALID_REQUEST
            else:
                offsets[name] = (k, p["committed_offset"])
        if offsets:
            try:
                store.commit(group, topic, {name: offset for name, (_, offset) in offsets.items()})
                errors.update((k, codes.NONE) for k, _ in offsets.values())
            except KazooException as e:
                log.warning("group %s: committing offsets of %s failed: %s", group, topic, e)
                errors.update((k, codes.COORDINATOR_NOT_AVAILABLE) for k, _ in offsets.values())
        return {k: errors[k] for k in parts}

    def offset_fetch(self, req: dict, version: int, allows=allow_all) -> dict:
        snap = self._cluster()
        if version >= 8:
            groups = [self._fetch_group(g["group_id"], g["topics"], version, allows, snap) for g in req["groups"]]
            return {"throttle_time_ms": 0, "groups": [
                {"group_id": g["group_id"], "topics": topics, "error_code": code}
                for g, (code, topics) in zip(req["groups"], groups)]}
        code, topics = self._fetch_group(req["group_id"], req["topics"], version, allows, snap)
        if version < 2 and code != codes.NONE:  # no top-level error yet: each partition says it
            for t in topics:
                for p in t["partitions"]:
                    p["error_code"] = code
        return {"throttle_time_ms": 0, "topics": topics, "error_code": code}

    def _fetch_group(self, group: str, asked: Optional[list], version: int, allows, snap: ClusterSnapshot) -> tuple:
        """(group error, topics) of one group's OffsetFetch."""
        by_id = version >= 10
        code = codes.GROUP_AUTHORIZATION_FAILED if not allows("Describe", "group", group) else self._ensure(group)
        store = self._store() if code is None else None
        if code is None and store is None:
            code = codes.COORDINATOR_NOT_AVAILABLE
        if code is not None:
            return code, [{"name": t.get("name"), "topic_id": t.get("topic_id", bytes(16)), "partitions": [
                _fetched(k, -1) for k in t["partition_indexes"]]} for t in asked or []]
        try:
            if asked is None:  # every topic the group committed for, that the caller may see
                names = [t for t in store.group_topics(group) if t in snap.maps and allows("Describe", "topic", t)]
                asked = [{"name": t, "topic_id": snap.maps[t].topic_id, "partition_indexes": None} for t in names]
            topics = [self._fetch_topic(store, group, t, by_id, allows, snap) for t in asked]
        except KazooException:
            return codes.COORDINATOR_NOT_AVAILABLE, []
        return codes.NONE, topics

    def _fetch_topic(self, store: GroupStore, group: str, asked: dict, by_id: bool, allows,
                     snap: ClusterSnapshot) -> dict:
        topic = snap.topic_by_id(asked["topic_id"]) if by_id else asked["name"]
        tmap = snap.maps.get(topic) if topic is not None else None
        out = {"name": topic or "", "topic_id": tmap.topic_id if tmap else asked.get("topic_id", bytes(16))}
        numbers = asked["partition_indexes"]
        if topic is None or (by_id and tmap is None):
            out["partitions"] = [_fetched(k, -1, codes.UNKNOWN_TOPIC_ID) for k in numbers or []]
        elif not allows("Describe", "topic", topic):
            out["partitions"] = [_fetched(k, -1, codes.TOPIC_AUTHORIZATION_FAILED) for k in numbers or []]
        else:
            committed = store.fetch(group, topic)
            if numbers is None:  # all of them: the committed partitions that have a Kafka number
                numbers = sorted(k for k in (tmap.number_of(p) for p in committed) if k is not None) if tmap else []
            out["partitions"] = [_fetched(k, committed.get(tmap.name_of(k) if tmap else None, -1)) for k in numbers]
        return out

    # -- whole groups ---------------------------------------------------------------------------------
    def list_groups(self, req: dict, version: int, allows=allow_all) -> dict:
        snap = self._cluster()
        mine = {g: (ptype, state) for g, ptype, state in self.coordinator.overview()}
        store = self._store()
        if store is None:
            return {"throttle_time_ms": 0, "error_code": codes.COORDINATOR_NOT_AVAILABLE, "groups": []}
        try:
            stored = store.groups()
        except KazooException:
            return {"throttle_time_ms": 0, "error_code": codes.COORDINATOR_NOT_AVAILABLE, "groups": []}
        for g in stored:  # groups kept here without members in memory: offsets only, or not taken over yet
            if g not in mine and kafka_metadata.coordinator_of(g, snap.brokers) == self.broker_id:
                mine[g] = ("", EMPTY)
        states = {s.lower() for s in req.get("states_filter") or ()}
        types = {t.lower() for t in req.get("types_filter") or ()}
        everything = allows("Describe", "cluster", CLUSTER)
        groups = [{"group_id": g, "protocol_type": ptype, "group_state": state, "group_type": CLASSIC}
                  for g, (ptype, state) in sorted(mine.items())
                  if (not states or state.lower() in states) and (not types or CLASSIC in types)
                  and (everything or allows("Describe", "group", g))]
        return {"throttle_time_ms": 0, "error_code": codes.NONE, "groups": groups}

    def describe_groups(self, req: dict, version: int, allows=allow_all) -> dict:
        return {"throttle_time_ms": 0, "groups": [self._describe(g, version, allows) for g in req["groups"]]}

    def _describe(self, group: str, version: int, allows) -> dict:
        code = self._check(group, "Describe", allows)
        if code is None:
            found = self.coordinator.describe(group)
            if found is not None:
                return found
            store = self._store()
            try:
                exists = store is not None and store.exists(group)
            except KazooException:
                store = None
            if store is None:
                code = codes.COORDINATOR_NOT_AVAILABLE
            elif exists:  # offsets only: Kafka says Empty
                return _group_entry(group, codes.NONE, EMPTY)
            elif version >= 6:
                return {**_group_entry(group, codes.GROUP_ID_NOT_FOUND, "Dead"),
                        "error_message": f"group {group!r} does not exist"}
            else:
                return _group_entry(group, codes.NONE, "Dead")
        return _group_entry(group, code, "")

    def delete_groups(self, req: dict, version: int, allows=allow_all) -> dict:
        return {"throttle_time_ms": 0, "results": [{"group_id": g, "error_code": self._delete(g, allows)}
                                                   for g in req["groups_names"]]}

    def _delete(self, group: str, allows) -> int:
        code = self._check(group, "Delete", allows)
        if code is not None:
            return code
        zk = self._zk()
        if zk is None:
            return codes.COORDINATOR_NOT_AVAILABLE
        store = GroupStore(zk, self.root)
        try:
            if zk_groups.native_members(zk, self.paths, group):
                return codes.NON_EMPTY_GROUP  # metaq's own consumers use it
            in_memory = self.coordinator.delete(group)
            if in_memory == codes.NON_EMPTY_GROUP:
                return in_memory
            if in_memory is None and not store.exists(group):
                return codes.GROUP_ID_NOT_FOUND
            store.delete(group)
        except KazooException:
            return codes.COORDINATOR_NOT_AVAILABLE
        with self._lock:
            self._versions.pop(group, None)
        log.info("group %s deleted with its offsets (DeleteGroups)", group)
        return codes.NONE


def _fetched(number: int, offset: int, code: int = codes.NONE) -> dict:
    return {"partition_index": number, "committed_offset": offset, "committed_leader_epoch": -1, "metadata": "",
            "error_code": code}


def _group_entry(group: str, code: int, state: str) -> dict:
    return {"error_code": code, "error_message": None, "group_id": group, "group_state": state,
            "protocol_type": "", "protocol_data": "", "members": []}
