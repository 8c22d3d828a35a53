"""What Metadata, DescribeCluster and FindCoordinator answer, from a ``ClusterSnapshot``
(``zk/kafka_cluster.py``): pure functions returning response bodies in the codec's field names
(``protocol/kafka/messages.py``), so the listener encodes them at the version asked for.

Kafka's model mapped onto metaq's (docs/kafka.md, "Metadata"):

* a node is a member of a broker group: member ``r`` of group ``b`` is node ``b + 1024 * r``
  (``zk/kafka_cluster.node_id``; an unreplicated broker is node ``b``). Every live member with a Kafka
  listener is listed; a partition's leader is its group's master, ``replicas`` the group's roster and
  ``isr`` its in-sync set. The leader epoch is the group's epoch.
* a topic's partitions are numbered by its partition map (``zk/kafka_partitions.py``); its Kafka topic id is
  the map's. Every number ever given is listed, so clients always see 0..N-1: one whose broker is down, has
  no Kafka listener, or was forgotten (``metaq brokers --forget``) is offline: leader -1,
  LEADER_NOT_AVAILABLE, its broker in ``offline_replicas``, as Kafka shows a partition whose replicas are all
  gone. A number is never reused, so a forgotten broker's numbers stay offline for good.
* the controller is the master with the lowest node id (Kafka's admin clients send topic changes there).
* the coordinator of a consumer group is the master of a broker group chosen by rendezvous hashing over the
  live broker ids with a Kafka listener: every broker computes the same one, a broker joining or leaving
  moves only the groups it gains or had, and a failover moves them to the group's new master.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Optional

from metaq_broker.errors import InvalidTopicError
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.protocol.kafka import codes
from metaq_broker.store.config import validate_topic_name
from metaq_broker.zk.kafka_cluster import ClusterSnapshot, KafkaBroker
from metaq_broker.zk.kafka_partitions import TopicMap

ENDPOINT_BROKERS = 1  # DescribeCluster's endpoint_type: brokers (2 asks for controllers: KRaft's, none here)
COORDINATOR_GROUP, COORDINATOR_TRANSACTION = 0, 1  # FindCoordinator's key_type
GROUPS_WITHOUT_ZOOKEEPER = ("consumer groups need ZooKeeper, where metaq keeps group offsets: this broker runs "
                            "with zk.connect=none; assign partitions to the consumer and keep offsets yourself")
TRANSACTIONS_REFUSED = ("metaq does not support Kafka transactions (the producer's transactional.id); "
                        "use an idempotent producer (enable.idempotence) without transactional.id")


# -- topics -----------------------------------------------------------------------------------------
def partition_entry(snap: ClusterSnapshot, topic: str, number: int, name: str) -> dict:
    """Metadata of Kafka partition ``number`` (metaq's ``name``): led by its broker when that broker is live,
    serves Kafka and still has the partition; offline otherwise."""
    broker_id, n = parse_partition_name(name)
    count = snap.topics.get(topic, {}).get(broker_id)
    epoch = snap.epochs.get(broker_id, -1)
    replicas, isr = snap.replica_nodes(broker_id)
    offline = [r for r in replicas if r not in snap.nodes]
    master = snap.brokers.get(broker_id)
    if count is not None and n < count and master is not None:
        return {"error_code": codes.NONE, "partition_index": number, "leader_id": master.node_id,
                "leader_epoch": epoch, "replica_nodes": replicas, "isr_nodes": isr, "offline_replicas": offline}
    return {"error_code": codes.LEADER_NOT_AVAILABLE, "partition_index": number, "leader_id": -1,
            "leader_epoch": epoch, "replica_nodes": replicas, "isr_nodes": [], "offline_replicas": offline}


def topic_entry(snap: ClusterSnapshot, topic: Optional[str], topic_id: Optional[bytes] = None) -> dict:
    """One topic of a Metadata answer, asked by name or (``topic`` None) by id: its partitions, or the error
    that says why there are none (unknown, invalid name, not numbered yet)."""
    if topic is None:
        topic = snap.topic_by_id(topic_id or bytes(16))
        if topic is None:
            return _topic_error("", codes.UNKNOWN_TOPIC_ID, topic_id)  # "": below v12 a name cannot be null
    try:
        validate_topic_name(topic)
    except InvalidTopicError:
        return _topic_error(topic, codes.INVALID_TOPIC_EXCEPTION)
    tmap = snap.maps.get(topic)
    if topic not in snap.topics:  # no broker has it (a map alone: every broker of it was forgotten)
        return _topic_error(topic, codes.UNKNOWN_TOPIC_OR_PARTITION)
    if tmap is None:  # published, not numbered yet: a topic being created, as Kafka says
        return _topic_error(topic, codes.LEADER_NOT_AVAILABLE)
    return {"error_code": codes.NONE, "name": topic, "topic_id": tmap.topic_id, "is_internal": False,
            "partitions": [partition_entry(snap, topic, k, p) for k, p in enumerate(tmap.partitions)]}


def _topic_error(topic: str, code: int, topic_id: Optional[bytes] = None) -> dict:
    return {"error_code": code, "name": topic, "topic_id": topic_id or bytes(16), "is_internal": False,
            "partitions": []}


def metadata(snap: ClusterSnapshot, requested: Optional[Iterable[dict]]) -> dict:
    """The Metadata answer for the request's ``topics`` (None: every topic that has numbers). Topics asked
    for that do not exist get UNKNOWN_TOPIC_OR_PARTITION: creating them (``autoCreateTopics``) is the
    listener's, before it calls this."""
    if requested is None:
        topics = [topic_entry(snap, t) for t in sorted(snap.topics) if t in snap.maps]
    else:
        topics = [topic_entry(snap, r.get("name"), r.get("topic_id")) for r in requested]
    return {"throttle_time_ms": 0, "brokers": broker_list(snap), "cluster_id": snap.cluster_id,
            "controller_id": controller(snap), "topics": topics, "error_code": codes.NONE}


# -- brokers ----------------------------------------------------------------------------------------
def broker_list(snap: ClusterSnapshot) -> list:
    return [{"node_id": b.node_id, "host": b.host, "port": b.port, "rack": None}
            for _, b in sorted(snap.nodes.items())]


def controller(snap: ClusterSnapshot) -> int:
    """The master with the lowest node id; -1 when there is none."""
    return min((b.node_id for b in snap.brokers.values()), default=-1)


def describe_cluster(snap: ClusterSnapshot, endpoint_type: int = ENDPOINT_BROKERS) -> dict:
    if endpoint_type != ENDPOINT_BROKERS:
        return {"error_code": codes.UNSUPPORTED_ENDPOINT_TYPE, "endpoint_type": endpoint_type,
                "error_message": f"endpoint type {endpoint_type}: metaq brokers describe brokers (type 1) only; "
                                 f"there are no KRaft controllers", "cluster_id": snap.cluster_id, "brokers": []}
    return {"throttle_time_ms": 0, "error_code": codes.NONE, "error_message": None, "endpoint_type": endpoint_type,
            "cluster_id": snap.cluster_id, "controller_id": controller(snap),
            "brokers": [{"broker_id": b.node_id, "host": b.host, "port": b.port, "rack": None, "is_fenced": False}
                        for _, b in sorted(snap.nodes.items())]}


# -- coordinators -----------------------------------------------------------------------------------
def coordinator_of(group: str, broker_ids: Iterable[int]) -> Optional[int]:
    """The broker (group) whose master coordinates ``group``: the highest hash of (group, broker id) among
    ``broker_ids`` (rendezvous hashing), None when there is no broker."""
    best, best_id = None, None
    for b in broker_ids:
        h = hashlib.blake2b(f"{b}\0{group}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        if best is None or h > best:
            best, best_id = h, b
    return best_id


def find_coordinator(snap: ClusterSnapshot, keys: list, key_type: int, refused=frozenset(),
                     groups: bool = True) -> list:
    """``[{"key", "node_id", "host", "port", "error_code", "error_message"}]`` for each key (v4+'s
    ``coordinators``; v0-3 answer the one key's fields at the top level). ``refused``: group ids the caller
    may not Describe (GROUP_AUTHORIZATION_FAILED); ``groups`` False: a broker without ZooKeeper, which
    coordinates no group (INVALID_REQUEST saying so: retrying would not help)."""
    out = []
    for key in keys:
        if key_type == COORDINATOR_GROUP and not groups:
            out.append(_no_coordinator(key, codes.INVALID_REQUEST, GROUPS_WITHOUT_ZOOKEEPER))
        elif key_type == COORDINATOR_GROUP and key in refused:
            out.append(_no_coordinator(key, codes.GROUP_AUTHORIZATION_FAILED, f"not authorized to describe group {key!r}"))
        elif key_type == COORDINATOR_TRANSACTION:
            out.append(_no_coordinator(key, codes.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, TRANSACTIONS_REFUSED))
        elif key_type != COORDINATOR_GROUP:
            out.append(_no_coordinator(key, codes.INVALID_REQUEST, f"unknown coordinator key type {key_type}"))
        elif not key:
            out.append(_no_coordinator(key, codes.INVALID_GROUP_ID, "the group id is empty"))
        else:
            b: Optional[KafkaBroker] = snap.brokers.get(coordinator_of(key, snap.brokers))
            if b is None:
                out.append(_no_coordinator(key, codes.COORDINATOR_NOT_AVAILABLE, "no broker with a Kafka listener "
                                                                                 "is alive"))
            else:
                out.append({"key": key, "node_id": b.node_id, "host": b.host, "port": b.port,
                            "error_code": codes.NONE, "error_message": None})
    return out


def _no_coordinator(key: str, code: int, message: str) -> dict:
    return {"key": key, "node_id": -1, "host": "", "port": -1, "error_code": code, "error_message": message}


def find_coordinator_response(snap: ClusterSnapshot, request: dict, version: int, refused=frozenset(),
                              groups: bool = True) -> dict:
    """The whole FindCoordinator answer for a decoded request of ``version`` (``groups``: as above)."""
    key_type = request.get("key_type", COORDINATOR_GROUP)
    if version >= 4:
        return {"throttle_time_ms": 0, "coordinators": find_coordinator(snap, list(request["coordinator_keys"]),
                                                                        key_type, refused, groups)}
    one = find_coordinator(snap, [request["key"]], key_type, refused, groups)[0]
    return {"throttle_time_ms": 0, "error_code": one["error_code"], "error_message": one["error_message"],
            "node_id": one["node_id"], "host": one["host"], "port": one["port"]}


# -- a broker without ZooKeeper ---------------------------------------------------------------------
def static_snapshot(broker_id: int, host: str, port: int, topics: dict, topic_ids: dict,
                    cluster_id: str, epoch: int = -1) -> ClusterSnapshot:
    """The cluster of a broker without ZooKeeper (``zk.connect=none``): itself, and each topic's partitions
    ``<brokerId>-0..N-1`` numbered 0..N-1 in order. ``topics``: {topic: numPartitions}; ``topic_ids``: {topic:
    16 bytes}, e.g. ``topic_id_of(identity of <topic>-0)``, which is durable and new when the topic is made
    again."""
    maps = {t: TopicMap(t, topic_ids[t], tuple(partition_name(broker_id, i) for i in range(n)))
            for t, n in topics.items()}
    return ClusterSnapshot(cluster_id, frozenset({broker_id}), {broker_id: KafkaBroker(broker_id, host, port)},
                           {broker_id: epoch} if epoch >= 0 else {}, {t: {broker_id: n} for t, n in topics.items()},
                           maps)


def topic_id_of(identity: str) -> bytes:
    """A topic id from a partition log's identity (32 hex digits, ``store/identity.py``)."""
    return bytes.fromhex(identity)
