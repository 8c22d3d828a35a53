"""What a Kafka listener answers from, kept in step with ZooKeeper: live brokers with their Kafka addresses,
each broker group's epoch, every topic's entries, the partition maps (zk/kafka_partitions.py) and the
cluster id. ``KafkaClusterCache`` follows the nodes with watches (kazoo's TreeCache on
``brokers/metaq/ids``, ``brokers/groups``, ``brokers/metaq/topics`` and ``kafka/topics``), so answering Metadata costs
no ZooKeeper request; ``snapshot()`` hands out an immutable ``ClusterSnapshot`` built again only after a
change. ``server/kafka_metadata.py`` turns a snapshot into Kafka's answers (pure functions).

A broker's Kafka address is in its master node's JSON (``brokers/metaq/ids/<b>``): ``host`` (its
``advertisedHostName``) and ``kafkaPort``, present while its Kafka listener is up; each member of a replicated
group has the same in its member node (``brokers/groups/<b>/members/<r>``).

Node ids: member ``r`` of broker group ``b`` is Kafka node ``b + 1024 * r`` (``node_id``), so an unreplicated
broker is node ``b`` and every member of a group is a node of its own, listed in Metadata. A partition's
leader is its group's master's node, its replicas and in-sync replicas the group's roster and in-sync set.
Kafka clients keep the brokers Metadata lists: when a master dies they ask a member that lives, which names
the new master once it is elected (with one node per group they knew only the dead address)."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from kazoo.recipe.cache import TreeCache, TreeEvent

from metaq_broker.zk import kafka_partitions
from metaq_broker.zk.groups import GroupState
from metaq_broker.zk.kafka_partitions import KafkaMapError, TopicMap
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)


REPLICA_STRIDE = 1024  # brokerId is 0..1023 (server/config.py): node ids of different members never meet


def node_id(broker_id: int, replica_id: int = 0) -> int:
    """Kafka's node id of member ``replica_id`` of broker group ``broker_id`` (replicaId 0: ``broker_id``)."""
    return broker_id + REPLICA_STRIDE * replica_id


@dataclass(frozen=True)
class KafkaBroker:
    """A live member's Kafka listener as Kafka clients see it: its node id (``node_id``) and address."""
    node_id: int
    host: str
    port: int


@dataclass(frozen=True)
class ClusterSnapshot:
    """The cluster at one moment. Treat the dicts as read-only: snapshots are shared."""

    cluster_id: str
    live: frozenset  # broker ids registered now (``brokers/metaq/ids``), Kafka listener or not
    brokers: dict  # brokerId -> KafkaBroker of its master, the live brokers with a Kafka listener
    epochs: dict  # brokerId -> its group's epoch (``brokers/groups/<b>/state``)
    topics: dict  # topic -> {brokerId: numPartitions}: its entries, the brokers' that are down included
    maps: dict  # topic -> TopicMap: Kafka's numbers and topic id
    nodes: dict = None  # node id -> KafkaBroker, every live member with a Kafka listener (default: the masters)
    rosters: dict = field(default_factory=dict)  # brokerId -> (its members' replicaIds, its in-sync replicaIds)
    _by_id: dict = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_by_id", {m.topic_id: t for t, m in self.maps.items()})
        if self.nodes is None:
            object.__setattr__(self, "nodes", {b.node_id: b for b in self.brokers.values()})

    def replica_nodes(self, broker_id: int) -> tuple:
        """(replicas, in-sync replicas) of broker group ``broker_id`` as node ids: its roster and in-sync set,
        its master's node in both; a broker without a group state is one node, in sync while it leads."""
        master = self.brokers.get(broker_id)
        roster, isr = self.rosters.get(broker_id, ((), ()))
        replicas = {node_id(broker_id, r) for r in roster}
        in_sync = {node_id(broker_id, r) for r in isr}
        if master is not None:
            replicas.add(master.node_id)
            in_sync.add(master.node_id)
        return sorted(replicas or {node_id(broker_id)}), sorted(in_sync)

    def topic_by_id(self, topic_id: bytes) -> Optional[str]:
        return self._by_id.get(bytes(topic_id))


def kafka_endpoint(broker_id: int, info, replica_id: Optional[int] = None) -> Optional[KafkaBroker]:
    """The Kafka address in a registration's JSON (a dict), None when it has none (listener off, or a broker
    of an older version). ``replica_id``: the member's (a member node's path says it); by default the JSON's
    ``replicaId`` (a master node's), 0 without one."""
    if not isinstance(info, dict):
        return None
    host, port = info.get("host"), info.get("kafkaPort")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536:
        return None
    if replica_id is None:
        replica_id = info.get("replicaId", 0)
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            replica_id = 0
    return KafkaBroker(node_id(broker_id, replica_id), host, port)


def build(cluster_id: str, nodes: dict, paths: ZkPaths) -> ClusterSnapshot:
    """A snapshot from ``{path: data}`` of the watched nodes; unreadable nodes are left out (and logged)."""
    ids, groups, pub, maps_root = (paths.broker_ids() + "/", paths.broker_groups() + "/", paths.topics() + "/",
                                   paths.kafka_topics() + "/")
    live, brokers, epochs, topics, maps, members, rosters = set(), {}, {}, {}, {}, {}, {}
    for path, data in nodes.items():
        try:
            if path.startswith(ids):
                name = path[len(ids):]
                if name.isdigit():
                    live.add(int(name))
                    endpoint = kafka_endpoint(int(name), json.loads(data))
                    if endpoint is not None:
                        brokers[int(name)] = endpoint
            elif path.startswith(groups):
                name, _, leaf = path[len(groups):].partition("/")
                kind, _, replica = leaf.partition("/")
                if name.isdigit() and leaf == "state":
                    state = GroupState.from_json(data)
                    epochs[int(name)] = state.epoch
                    rosters[int(name)] = (state.replicas, state.isr_ids)
                elif name.isdigit() and kind == "members" and replica.isdigit():
                    endpoint = kafka_endpoint(int(name), json.loads(data), int(replica))
                    if endpoint is not None:
                        members[endpoint.node_id] = endpoint
            elif path.startswith(pub):
                topic, _, entry = path[len(pub):].partition("/")
                if entry.endswith("-m") and entry[:-2].isdigit() and "/" not in entry:
                    count = int(json.loads(data)["numPartitions"])
                    if count > 0:
                        topics.setdefault(topic, {})[int(entry[:-2])] = count
            elif path.startswith(maps_root):
                topic = path[len(maps_root):]
                if "/" not in topic:
                    maps[topic] = TopicMap.from_json(topic, data)
        except (ValueError, KeyError, TypeError, KafkaMapError) as e:
            log.warning("Kafka metadata: ignoring %s: %s", path, e)
    members.update((b.node_id, b) for b in brokers.values())
    return ClusterSnapshot(cluster_id, frozenset(live), brokers, epochs, topics, maps, members, rosters)


class KafkaClusterCache:
    """Watches the nodes Kafka's answers come from; ``snapshot()`` is a dictionary copy at most once per
    change. ``on_change`` callbacks run on a kazoo thread after each change and must not block."""

    def __init__(self, zk, root: str, timeout: float = 15.0, acl=None):
        self.paths = ZkPaths(root)
        self.cluster_id = kafka_partitions.cluster_id(zk, self.paths, acl)
        self._lock = threading.Lock()  # guards _nodes, _snapshot
        self._nodes: dict = {}  # path -> data of every watched node below the four roots
        self._snapshot: Optional[ClusterSnapshot] = None
        self._listeners: list = []
        roots = (self.paths.broker_ids(), self.paths.broker_groups(), self.paths.topics(),
                 self.paths.kafka_topics())
        self._trees, ready = [], []
        for path in roots:
            tree, event = TreeCache(zk, path), threading.Event()
            tree.listen(lambda e, root=path, t=tree, ev=event: self._on_event(root, t, ev, e))
            tree.listen_fault(lambda e, root=path: log.error("the Kafka metadata cache of %s failed: %s", root, e))
            self._trees.append(tree)
            ready.append(event)
        for tree in self._trees:
            tree.start()
        for path, event in zip(roots, ready):
            if not event.wait(timeout):
                log.warning("%s not loaded from ZooKeeper within %.0fs; Kafka metadata lacks it until it is",
                            path, timeout)

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:
            if self._snapshot is None:
                self._snapshot = build(self.cluster_id, self._nodes, self.paths)
            return self._snapshot

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def close(self) -> None:
        for tree in self._trees:
            tree.close()

    def _on_event(self, root: str, tree: TreeCache, ready: threading.Event, event) -> None:
        if event.event_type == TreeEvent.INITIALIZED:
            changed = self._reload(root, tree)
            ready.set()
            if not changed:
                return
        else:
            data = event.event_data
            if data is None or not data.path.startswith(root + "/"):
                return  # connection events, and the root node itself
            with self._lock:
                if event.event_type in (TreeEvent.NODE_ADDED, TreeEvent.NODE_UPDATED):
                    self._nodes[data.path] = data.data
                elif event.event_type == TreeEvent.NODE_REMOVED:
                    self._nodes.pop(data.path, None)
                else:
                    return
                self._snapshot = None
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # noqa: BLE001 - one bad listener must not stop the cache
                log.exception("Kafka metadata change listener failed")

    def _reload(self, root: str, tree: TreeCache) -> bool:
        """Every node below ``root`` again from its tree, at the first load and after each new session: a node
        that a ZooKeeper which lost its data wrote again can have the old node's mzxid, and TreeCache then
        tells no change (it still holds the new data). True if anything changed."""
        nodes = dict(_tree_nodes(tree, root))
        with self._lock:
            held = {p: d for p, d in self._nodes.items() if p.startswith(root + "/")}
            if held == nodes:
                return False
            for path in held:
                del self._nodes[path]
            self._nodes.update(nodes)
            self._snapshot = None
            return True


def _tree_nodes(tree: TreeCache, path: str):
    """(path, data) of every node below ``path`` that ``tree`` holds."""
    for child in tree.get_children(path) or ():
        below = f"{path}/{child}"
        node = tree.get_data(below)
        if node is not None:
            yield below, node.data
        yield from _tree_nodes(tree, below)
