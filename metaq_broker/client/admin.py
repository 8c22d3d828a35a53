"""Administration across brokers: topics, partitions, offsets, consumer groups and their lag, stats."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Optional, Union

from kazoo.exceptions import NoNodeError

from metaq_broker.client.base import ClientBase
from metaq_broker.errors import InvalidPartitionError, MetaqError, OffsetOutOfRangeError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol.services import DELETE_TOPIC, DESCRIBE_GROUPS, groups_path, topics_path
from metaq_broker.zk.group_offsets import GroupHasMembersError, GroupStore, UnknownGroupError
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk import layout_upgrade, metaq_nodes, topic_entries
from metaq_broker.zk.kafka_cluster import kafka_endpoint
from metaq_broker.zk.starting import waiting_brokers
from metaq_broker.zk.session import children


@dataclass(frozen=True)
class PartitionInfo:
    topic: str
    partition: str
    broker_id: int
    earliest: int
    latest: int
    bytes: int
    segments: int
    closed: bool


@dataclass(frozen=True)
class GroupLag:
    group: str
    topic: str
    partition: str
    committed: Optional[int]  # None: the group has committed nothing for this partition
    latest: int  # the last stable offset: where readers stop (an open transaction holds back what follows)

    @property
    def lag(self) -> int:
        """Offsets, not messages: transaction markers and aborted messages count too."""
        return self.latest - (self.committed or 0)


@dataclass(frozen=True)
class GroupView:
    """A consumer group as ``describe_groups`` finds it."""
    group: str
    members: list  # consumer ids of its live members (balanced consumption)
    topics: dict  # topic -> ({partition: committed offset}, {partition: owning member})


@dataclass(frozen=True)
class OffsetReset:
    """One partition of a ``reset_offsets`` plan."""
    topic: str
    partition: str
    old: Optional[int]  # None: the group had committed nothing for this partition
    new: int


@dataclass(frozen=True)
class BrokerStatus:
    """One broker as ``brokers_status`` finds it: ``live`` (registered) or ``starting`` (restarted after a
    crash, waiting for ZooKeeper to expire its previous run's session until about ``expected_expiry``)."""
    broker_id: int
    address: str
    state: str
    since: Optional[float] = None  # starting: when it began to wait (seconds since the epoch)
    expected_expiry: Optional[float] = None  # starting: when the previous session should be gone

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        if self.expected_expiry is None:
            return None
        return max(0.0, self.expected_expiry - (time.time() if now is None else now))

    def describe(self, now: Optional[float] = None) -> str:
        if self.state != "starting":
            return self.state
        left = self.seconds_left(now)
        return ("starting: waiting for the previous ZooKeeper session to expire, "
                + (f"~{left:.0f}s left" if left else "any moment now"))


class Admin(ClientBase):
    def masters(self) -> dict:
        """{brokerId: "host:port"} of every live broker (group), at its master: where clients route."""
        return dict(self.cluster.brokers())

    def brokers(self) -> list:
        """One dict per member of every live broker group (a broker without replicas is a group of one),
        by brokerId and replicaId: ``brokerId``, ``replicaId``, ``address``, ``dataAddress``, ``role``
        (master, replica, starting, down; electing while the group has no master), ``epoch``, ``inSync``,
        ``lagMessages`` (offsets the member is behind the master's log end, summed over partitions; None
        when unknown) and ``error`` (why the master did not describe the group: the other fields then come
        from ZooKeeper, without lag). The master answers ``DescribeGroup``, asked once: a listing must not
        wait for an election."""
        masters = self.masters()
        rows = []
        for bid in sorted(set(masters) | set(self._masterless_groups())):
            rows.extend(self._group_rows(bid, masters.get(bid)))
        return rows

    def _group_rows(self, bid: int, address: Optional[str]) -> list:
        error = "no master"
        for attempt in range(2):  # again once at the master ZooKeeper names now, if it moved meanwhile
            if address is None:
                break
            try:
                conn = self.connection(bid) if attempt == 0 else self.pool.get(address)
                d = conn.call("DescribeGroup", pb.DescribeGroupRequest(), timeout=min(self.pool.timeout, 5.0),
                              retries=1, wait_for_ready=False)  # a dead master fails now, not at the timeout
                return [_member_row(bid, d.epoch, m, address if m.role == "master" else "") for m in d.members]
            except MetaqError as e:
                if getattr(e, "code", None) is not None and e.code.name == "UNIMPLEMENTED":  # an older broker
                    return [_member_row(bid, 0, pb.GroupMemberInfo(role="master", in_sync=True), address)]
                error = str(e)
            moved = self._master_address(bid)
            address = moved if moved != address else None
        if self.cluster.zk is None:
            return [{"brokerId": bid, "replicaId": None, "address": address or "", "dataAddress": "",
                     "role": "not answering", "epoch": None, "inSync": None, "lagMessages": None, "error": error}]
        return self._zk_group_rows(bid, error)

    def _zk_group_rows(self, bid: int, error: str) -> list:
        """A group's members as ZooKeeper has them (state, member nodes, the master node), without lag."""
        zk, paths = self.cluster.zk, self.cluster.paths
        state = zk_groups.read_state(zk, paths, bid)
        live = zk_groups.members(zk, paths, bid)
        starting = zk_groups.starting(zk, paths, bid)
        node = zk_groups.master_node(zk, paths, bid)
        master = None if node is None else node.get("replicaId", 0)
        ids = set(live) | starting | (set(state.replicas) if state is not None else set())
        if master is not None:
            ids.add(master)
        rows = []
        for r in sorted(ids):
            address, data_address = zk_groups.addresses(live.get(r, {}))
            role = ("master" if r == master else "starting" if r in starting else
                    ("replica" if master is not None else "electing") if r in live else "down")
            rows.append({"brokerId": bid, "replicaId": r, "address": address, "dataAddress": data_address,
                         "role": role, "epoch": state.epoch if state is not None else 0,
                         "inSync": r in state.isr_ids if state is not None else r == master,
                         "lagMessages": 0 if r == master else None, "error": error})
        return rows

    def _master_address(self, bid: int) -> Optional[str]:
        """``host:port`` in ``/brokers/ids/<bid>`` now (not the cached view); None without it or ZooKeeper."""
        if self.cluster.zk is None:
            return None
        node = zk_groups.master_node(self.cluster.zk, self.cluster.paths, bid)
        return None if node is None else zk_groups.addresses(node)[0] or None

    def _masterless_groups(self) -> list:
        """Broker ids of groups with live (or starting) members but no master now; [] without ZooKeeper."""
        zk, paths = self.cluster.zk, self.cluster.paths
        if zk is None:
            return []
        masters = self.masters()
        out = []
        for name in children(zk, paths.broker_groups()):
            if name.isdigit() and int(name) not in masters and (
                    children(zk, paths.group_members(int(name))) or zk_groups.starting(zk, paths, int(name))):
                out.append(int(name))
        return out

    def topics(self) -> dict:
        """{topic: [partition names]} over live brokers."""
        return {t: self.partitions(t) for t in sorted(self.cluster.topics())}

    def listed_topics(self) -> list:
        """The topics live brokers list to this client: with ACLs, only those its principal may Describe
        (``ListTopics``, as Kafka's metadata), where ZooKeeper's registrations show every topic."""
        out = set()
        for bid in sorted(self.cluster.brokers()):
            out.update(t.topic for t in self.call(bid, "ListTopics", pb.ListTopicsRequest(), retries=3).topics)
        return sorted(out)

    def describe(self, topic: str) -> list:
        out = []
        for bid in sorted({b for b, _ in self.cluster.topic_partitions(topic)}):
            d = self.call(bid, "DescribeTopic", pb.TopicRequest(topic=topic), retries=3)
            out.extend(PartitionInfo(topic, p.name, bid, p.earliest, p.latest, p.bytes, p.segments, p.closed)
                       for p in d.partitions)
        return out

    def create_topic(self, topic: str, num_partitions: int = 0, broker_ids: Optional[list] = None,
                     config: Optional[dict] = None) -> list:
        """Create ``topic`` on the given brokers (default: every live broker), ``num_partitions`` each
        (0: each broker's numPartitions). Creating an existing topic with the same count is a no-op."""
        ids = sorted(self.cluster.brokers()) if broker_ids is None else broker_ids
        if not ids:
            raise RuntimeError("no live broker to create the topic on")
        for bid in ids:
            self.call(bid, "CreateTopic", pb.CreateTopicRequest(
                topic=topic, num_partitions=num_partitions, config={k: str(v) for k, v in (config or {}).items()}))
        return [p for bid in ids for p in self._describe_on(bid, topic)]

    def delete_topic(self, topic: str, timeout_s: float = 30.0) -> bool:
        """Delete ``topic`` on every broker and member of its groups, with its groups' offsets (Kafka's
        DeleteTopics; Delete on the topic): True once done, False if it is recorded but not done within
        ``timeout_s`` (a broker that has it is down: it finishes when that broker is back)."""
        request = {"topic": topic, "timeoutMs": int(timeout_s * 1000)}
        return bool(self.broker_json_call(topics_path(DELETE_TOPIC), request, timeout_s + 15)["done"])

    def _describe_on(self, bid: int, topic: str) -> list:
        d = self.call(bid, "DescribeTopic", pb.TopicRequest(topic=topic), retries=3)
        return [p.name for p in d.partitions]

    def close_partitions(self, topic: str, broker_id: int, start: int, end: int) -> None:
        self.call(broker_id, "ClosePartitions", pb.PartitionRangeRequest(topic=topic, start=start, end=end))

    def open_partitions(self, topic: str, broker_id: int) -> None:
        self.call(broker_id, "OpenPartitions", pb.TopicRequest(topic=topic))

    def stats(self, broker_id: int, topic: str = "") -> pb.StatsResponse:
        return self.call(broker_id, "Stats", pb.StatsRequest(topic=topic), retries=3)

    def prepared_transactions(self, broker_id: int) -> list:
        """The broker's prepared transactions awaiting an outcome (XA recover)."""
        return list(self.call(broker_id, "RecoverTransactions", pb.RecoverTransactionsRequest(),
                                                    retries=3).transactions)

    # -- groups ---------------------------------------------------------------------------------------
    def _groups(self):
        if self.cluster.zk is None:
            raise RuntimeError("consumer groups live in ZooKeeper: create the admin with zk_connect")
        return GroupStore(self.cluster.zk, self.cluster.root)

    def groups(self) -> list:
        return self._groups().groups()

    def group_lag(self, group: str, topic: Optional[str] = None) -> list:
        """Committed offset, latest offset and lag for each partition of each topic the group has
        committed for (or just ``topic``)."""
        store = self._groups()
        return [row for t in ([topic] if topic else store.group_topics(group))
                for row in self.lag_of(group, t, store.fetch(group, t))]

    def lag_of(self, group: str, topic: str, committed: dict) -> list:
        """``GroupLag`` rows of ``topic`` for a group that committed ``committed`` ({partition: offset})."""
        latest = self.offsets(topic)
        return [GroupLag(group, topic, p, committed.get(p), latest.get(p, (0, 0))[1])
                for p in sorted(set(committed) | set(latest))]

    def describe_groups(self) -> list:
        """Every consumer group as ``GroupView``: through a broker when this client keeps offsets there
        (``group_offsets_via_broker``: only the groups and topics its principal may Describe), else
        from ZooKeeper."""
        if self.group_offsets_via_broker:
            found = self.broker_json_call(groups_path(DESCRIBE_GROUPS), {})["groups"]
            return [GroupView(g["group"], g["members"], {t: (v["offsets"], v["owners"]) for t, v in g["topics"].items()})
                    for g in found]
        store = self._groups()
        return [GroupView(g, store.members(g), {t: (store.fetch(g, t), store.owners(g, t)) for t in store.group_topics(g)})
                for g in store.groups()]

    # -- group operations (``metaq groups reset-offsets`` and ``delete``) -----------------------------
    def group_members(self, group: str) -> list:
        """Consumer ids of the group's live members (``<root>/consumers/<group>/ids``)."""
        return self._groups().members(group)

    def _idle_group(self, store: GroupStore, group: str, force: bool) -> None:
        if not store.exists(group):
            raise UnknownGroupError(f"no consumer group {group!r} (groups: {', '.join(store.groups()) or 'none'})")
        members = store.members(group)
        if members and not force:
            raise GroupHasMembersError(f"group {group!r} has {len(members)} live member(s) ({', '.join(members)}): "
                                       f"stop them first, or force it (--force)")

    def reset_offsets(self, group: str, topic: str, to: Union[str, int, datetime],
                      partitions: Optional[Iterable[str]] = None, dry_run: bool = False,
                      force: bool = False) -> list:
        """Move the group's committed offsets for ``topic`` (its partitions on live brokers, or just
        ``partitions``) to ``"earliest"``, ``"latest"`` (the last stable offset), an offset, or the first
        offset stored at or after a datetime; one ZooKeeper transaction. Refused while the group has live
        members unless ``force`` (they would overwrite it, or read on from where they are). Returns the
        plan, written unless ``dry_run``."""
        store = self._groups()
        self._idle_group(store, group, force)
        names = self.partitions(topic)
        chosen = list(dict.fromkeys(partitions or names))
        unknown = [p for p in chosen if p not in names]
        if unknown:
            raise InvalidPartitionError(f"topic {topic!r} has no live partition {', '.join(unknown)} "
                                        f"(partitions: {', '.join(names)})")
        if isinstance(to, datetime):
            at = {p: o[2] for p, o in self.offsets(topic, chosen, timestamp_ms=int(to.timestamp() * 1000)).items()}
        elif to in ("earliest", "latest"):
            at = {p: o[0 if to == "earliest" else 1] for p, o in self.offsets(topic, chosen).items()}
        elif isinstance(to, int) and not isinstance(to, bool):
            bounds = self.offsets(topic, chosen)
            for p in chosen:
                earliest, latest = bounds[p]
                if not earliest <= to <= latest:
                    raise OffsetOutOfRangeError(f"partition {p} of topic {topic!r}", to, earliest, latest)
            at = dict.fromkeys(chosen, to)
        else:
            raise ValueError(f"reset to 'earliest', 'latest', an offset or a datetime, not {to!r}")
        old = store.fetch(group, topic)
        plan = [OffsetReset(topic, p, old.get(p), at[p]) for p in chosen]
        if not dry_run:
            store.commit(group, topic, {r.partition: r.new for r in plan})
        return plan

    def delete_group(self, group: str, force: bool = False) -> None:
        """Remove the group with its offsets; refused while it has live members unless ``force``."""
        store = self._groups()
        self._idle_group(store, group, force)
        store.delete(group)

    # -- brokers, starting ones included (``metaq brokers``) ------------------------------------------
    def brokers_status(self) -> list:
        """Every broker, live, starting (waiting for its crashed previous run's ZooKeeper session to
        expire: ``<root>/brokers/starting``) or a replicated group with live members but ``no master`` now,
        by id. A static broker list knows only live ones."""
        zk = self.cluster.zk
        if zk is None:
            return [BrokerStatus(bid, addr, "live") for bid, addr in sorted(self.cluster.brokers().items())]
        out = {bid: BrokerStatus(bid, addr, "live") for bid, addr in self.cluster.brokers().items()}
        for bid, info in waiting_brokers(zk, self.cluster.paths).items():
            out[bid] = BrokerStatus(bid, info.get("address", ""), "starting", info.get("since"),
                                    info.get("expectedExpiry"))
        for bid in self._masterless_groups():  # members alive, none master: an election, or none may stand
            out.setdefault(bid, BrokerStatus(bid, "", "no master"))
        return [out[bid] for bid in sorted(out)]

    def kafka_addresses(self) -> dict:
        """{brokerId: "host:port"} of the live brokers' Kafka listeners, as Kafka clients are given them
        (the registration's ``host``, i.e. advertisedHostName, and ``kafkaPort``); empty without ZooKeeper."""
        zk = self.cluster.zk
        if zk is None:
            return {}
        out = {}
        for name in children(zk, self.cluster.paths.broker_ids()):
            if not name.isdigit():
                continue
            try:
                endpoint = kafka_endpoint(int(name), json.loads(zk.get(self.cluster.paths.broker(int(name)))[0]))
            except (NoNodeError, ValueError):
                continue
            if endpoint is not None:
                out[int(name)] = f"{endpoint.host}:{endpoint.port}"
        return out

    def forget_broker(self, broker_id: int) -> list:
        """Remove a broker for good: its topic entries, which stay while it is down (so keys keep their
        partition), go, and keys hash over the remaining partitions. Refused while it is live or starting.
        Returns the topics it had."""
        zk = self.cluster.zk
        if zk is None:
            raise RuntimeError("topic entries live in ZooKeeper: create the admin with zk_connect")
        status = {s.broker_id: s for s in self.brokers_status()}
        if broker_id in status:
            raise InvalidPartitionError(f"broker {broker_id} is {status[broker_id].describe()}: stop it first")
        topics = topic_entries.topics_of(zk, self.cluster.paths, broker_id)
        for topic in topics:
            topic_entries.delete(zk, self.cluster.paths, topic, broker_id)
        older = layout_upgrade.forget(zk, self.cluster.paths, broker_id)  # entries of the layout before issue 28
        metaq_nodes.forget(zk, self.cluster.layout, broker_id)  # MetaQ's brokers/ids/<b>, without a live child
        return sorted(set(topics) | set(older))


def _member_row(bid: int, epoch: int, m, address: str) -> dict:
    """A ``GroupMemberInfo`` as a row of ``Admin.brokers``; ``address`` where the member does not say."""
    return {"brokerId": bid, "replicaId": m.replica_id, "address": m.address or address,
            "dataAddress": m.data_address, "role": m.role, "epoch": epoch, "inSync": m.in_sync,
            "lagMessages": None if m.lag_offsets < 0 else m.lag_offsets, "error": None}
