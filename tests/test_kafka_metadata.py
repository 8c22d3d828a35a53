"""What Metadata, DescribeCluster and FindCoordinator answer (server/kafka_metadata.py), from hand-built cluster
snapshots: leaders, epochs, replicas and in-sync replicas of replicated groups (a Kafka node per member), offline
partitions of a broker that is down, has no Kafka listener or was forgotten, topics by name and by id, topics
not numbered yet, the controller, coordinators by rendezvous hashing (few groups move when a broker joins or
leaves), a broker without ZooKeeper. Every answer is encoded at each version served."""
import collections
import json

import pytest

from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.messages import APIS
from metaq_broker.protocol.kafka.schema import decode, encode_parts
from metaq_broker.server import kafka_metadata as km
from metaq_broker.zk.groups import GroupState
from metaq_broker.zk.kafka_cluster import ClusterSnapshot, KafkaBroker, build, kafka_endpoint
from metaq_broker.zk.kafka_partitions import TopicMap
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit

METADATA, FIND_COORDINATOR, DESCRIBE_CLUSTER = 3, 10, 60
ID_T, ID_U = bytes(range(16)), bytes(range(16, 32))


def readable(api_key: int, body: dict, versions=None) -> dict:
    """``body`` encoded and decoded at every version served (or ``versions``); the last decoded."""
    api = APIS[api_key]
    lo, hi = api.supported
    for v in versions or range(lo, hi + 1):
        flexible = api.is_flexible(v)
        raw = b"".join(bytes(p) for p in encode_parts(api.response, v, flexible, body))
        out, _ = decode(api.response, v, flexible, raw)
    return out


def snapshot(**kw) -> ClusterSnapshot:
    """Brokers 1 and 2 live with Kafka listeners, 3 live without one, 4 down; topic t on 1, 2, 4 and a
    forgotten 5; broker 1 is a replicated group at epoch 7."""
    base = dict(cluster_id="clusterid-22-chars-abc", live=frozenset({1, 2, 3}),
                brokers={1: KafkaBroker(1, "b1.example", 9092), 2: KafkaBroker(2, "b2.example", 9093)},
                epochs={1: 7, 2: 1, 4: 3},
                topics={"t": {1: 2, 2: 1, 4: 1}, "u": {3: 1}, "fresh": {1: 1}},
                maps={"t": TopicMap("t", ID_T, ("1-0", "2-0", "1-1", "4-0", "5-0")),
                      "u": TopicMap("u", ID_U, ("3-0",))})
    base.update(kw)
    return ClusterSnapshot(**base)


def test_metadata_of_every_topic():
    m = readable(METADATA, km.metadata(snapshot(), None))
    assert [(b["node_id"], b["host"], b["port"]) for b in m["brokers"]] == [(1, "b1.example", 9092),
                                                                            (2, "b2.example", 9093)]
    assert (m["cluster_id"], m["controller_id"]) == ("clusterid-22-chars-abc", 1)
    topics = {t["name"]: t for t in m["topics"]}
    assert set(topics) == {"t", "u"}  # "fresh" has no numbers yet: not listed
    t = topics["t"]
    assert t["error_code"] == codes.NONE and t["topic_id"] == ID_T
    rows = [(p["partition_index"], p["error_code"], p["leader_id"], p["leader_epoch"], p["replica_nodes"],
             p["isr_nodes"], p["offline_replicas"]) for p in t["partitions"]]
    assert rows == [
        (0, codes.NONE, 1, 7, [1], [1], []),  # its group's epoch is the leader epoch
        (1, codes.NONE, 2, 1, [2], [2], []),
        (2, codes.NONE, 1, 7, [1], [1], []),
        (3, codes.LEADER_NOT_AVAILABLE, -1, 3, [4], [], [4]),  # broker 4 is down
        (4, codes.LEADER_NOT_AVAILABLE, -1, -1, [5], [], [5]),  # broker 5 was forgotten: the number stays
    ]
    u = topics["u"]["partitions"][0]  # broker 3 is alive without a Kafka listener
    assert (u["error_code"], u["leader_id"], u["offline_replicas"]) == (codes.LEADER_NOT_AVAILABLE, -1, [3])


def test_a_partition_its_broker_no_longer_has_is_offline():
    snap = snapshot(topics={"t": {1: 1, 2: 1, 4: 1}})  # broker 1 was restarted with one partition of t
    t = km.topic_entry(snap, "t")
    assert [(p["partition_index"], p["leader_id"]) for p in t["partitions"]] == [(0, 1), (1, 2), (2, -1), (3, -1),
                                                                                 (4, -1)]


def test_metadata_of_named_topics_and_ids():
    m = readable(METADATA, km.metadata(snapshot(), [{"name": "t", "topic_id": bytes(16)}, {"name": "nope"},
                                                    {"name": "fresh"}, {"name": "bad/name"},
                                                    {"name": None, "topic_id": ID_U},
                                                    {"name": None, "topic_id": b"\x09" * 16}]))
    got = [(t["name"], t["error_code"], len(t["partitions"])) for t in m["topics"]]
    assert got == [("t", codes.NONE, 5), ("nope", codes.UNKNOWN_TOPIC_OR_PARTITION, 0),
                   ("fresh", codes.LEADER_NOT_AVAILABLE, 0), ("bad/name", codes.INVALID_TOPIC_EXCEPTION, 0),
                   ("u", codes.NONE, 1), ("", codes.UNKNOWN_TOPIC_ID, 0)]
    assert m["topics"][4]["topic_id"] == ID_U


def test_a_topic_every_broker_of_which_was_forgotten_is_unknown():
    snap = snapshot(topics={"u": {3: 1}})
    assert km.topic_entry(snap, "t")["error_code"] == codes.UNKNOWN_TOPIC_OR_PARTITION


def test_no_kafka_broker_alive():
    snap = snapshot(brokers={}, live=frozenset())
    m = readable(METADATA, km.metadata(snap, None))
    assert m["brokers"] == [] and m["controller_id"] == -1
    assert all(p["leader_id"] == -1 for t in m["topics"] for p in t["partitions"])
    assert readable(FIND_COORDINATOR, km.find_coordinator_response(snap, {"key": "g", "key_type": 0}, 3),
                    range(0, 4))["error_code"] == codes.COORDINATOR_NOT_AVAILABLE


def test_describe_cluster():
    d = readable(DESCRIBE_CLUSTER, km.describe_cluster(snapshot()))
    assert d["error_code"] == codes.NONE and d["controller_id"] == 1 and d["cluster_id"] == "clusterid-22-chars-abc"
    assert [(b["broker_id"], b["host"], b["port"], b["is_fenced"]) for b in d["brokers"]] == \
        [(1, "b1.example", 9092, False), (2, "b2.example", 9093, False)]
    refused = readable(DESCRIBE_CLUSTER, km.describe_cluster(snapshot(), endpoint_type=2))
    assert refused["error_code"] == codes.UNSUPPORTED_ENDPOINT_TYPE and "controllers" in refused["error_message"]


def test_find_coordinator_every_version():
    snap = snapshot()
    old = readable(FIND_COORDINATOR, km.find_coordinator_response(snap, {"key": "orders-app", "key_type": 0}, 3),
                   range(0, 4))
    owner = km.coordinator_of("orders-app", [1, 2])
    assert old["error_code"] == codes.NONE and old["node_id"] == owner
    assert (old["host"], old["port"]) == ((snap.brokers[owner].host, snap.brokers[owner].port))
    new = readable(FIND_COORDINATOR, km.find_coordinator_response(
        snap, {"key_type": 0, "coordinator_keys": ["orders-app", "", "secret"]}, 6, refused={"secret"}), range(4, 7))
    rows = [(c["key"], c["node_id"], c["error_code"]) for c in new["coordinators"]]
    assert rows == [("orders-app", owner, codes.NONE), ("", -1, codes.INVALID_GROUP_ID),
                    ("secret", -1, codes.GROUP_AUTHORIZATION_FAILED)]
    txn = readable(FIND_COORDINATOR, km.find_coordinator_response(snap, {"key_type": 1, "coordinator_keys": ["tx"]}, 4),
                   range(4, 7))
    assert txn["coordinators"][0]["error_code"] == codes.TRANSACTIONAL_ID_AUTHORIZATION_FAILED  # fatal to the client
    assert "transactional.id" in txn["coordinators"][0]["error_message"]


def test_rendezvous_placement_is_stable_spread_and_moves_little():
    groups = [f"group-{i}" for i in range(3000)]
    before = {g: km.coordinator_of(g, [1, 2, 3, 4]) for g in groups}
    assert before == {g: km.coordinator_of(g, [4, 3, 2, 1]) for g in groups}  # order does not matter
    counts = collections.Counter(before.values())
    assert set(counts) == {1, 2, 3, 4} and min(counts.values()) > 600  # about 750 each
    joined = {g: km.coordinator_of(g, [1, 2, 3, 4, 5]) for g in groups}
    moved = [g for g in groups if joined[g] != before[g]]
    assert all(joined[g] == 5 for g in moved) and 450 < len(moved) < 750  # only to the new broker, ~1/5
    left = {g: km.coordinator_of(g, [1, 2, 4]) for g in groups}
    assert all(left[g] == before[g] for g in groups if before[g] != 3)  # only broker 3's groups move
    assert km.coordinator_of("g", []) is None


def test_a_broker_without_zookeeper_numbers_its_own_partitions_in_order():
    ident = "0123456789abcdef0123456789abcdef"
    snap = km.static_snapshot(3, "h", 9092, {"t": 3}, {"t": km.topic_id_of(ident)}, "static-cluster", epoch=0)
    t = readable(METADATA, km.metadata(snap, None))["topics"][0]
    assert t["topic_id"] == bytes.fromhex(ident)
    assert [(p["partition_index"], p["leader_id"], p["leader_epoch"]) for p in t["partitions"]] == \
        [(0, 3, 0), (1, 3, 0), (2, 3, 0)]
    assert snap.maps["t"].partitions == ("3-0", "3-1", "3-2")
    refused = readable(FIND_COORDINATOR, km.find_coordinator_response(snap, {"key": "g", "key_type": 0}, 3,
                                                                      groups=False), range(1, 4))
    assert refused["error_code"] == codes.INVALID_REQUEST and "zk.connect=none" in refused["error_message"]


@pytest.mark.parametrize("info,expected", [
    ({"host": "h", "port": 8123, "kafkaPort": 9092}, KafkaBroker(1, "h", 9092)),
    ({"host": "h", "port": 8123}, None),  # no Kafka listener
    ({"host": "h", "kafkaPort": 0}, None), ({"host": "h", "kafkaPort": True}, None), ({"host": "", "kafkaPort": 1}, None),
    ({"host": "h", "kafkaPort": "9092"}, None), ("not a dict", None),
])
def test_kafka_endpoint_of_a_registration(info, expected):
    assert kafka_endpoint(1, info) == expected


@pytest.mark.parametrize("info,replica,expected", [
    ({"host": "h", "kafkaPort": 9092, "replicaId": 2}, None, KafkaBroker(1 + 2 * 1024, "h", 9092)),  # a master node
    ({"host": "h", "kafkaPort": 9092, "replicaId": 2}, 1, KafkaBroker(1 + 1024, "h", 9092)),  # the path says
    ({"host": "h", "kafkaPort": 9092, "replicaId": -1}, None, KafkaBroker(1, "h", 9092)),
    ({"host": "h", "kafkaPort": 9092, "replicaId": "2"}, None, KafkaBroker(1, "h", 9092)),
])
def test_each_member_is_a_node_of_its_own(info, replica, expected):
    assert kafka_endpoint(1, info, replica) == expected


def group_nodes(paths: ZkPaths, master: int, members: dict, isr=(0, 1, 2)) -> dict:
    """ZooKeeper's nodes of broker group 1 (members {replicaId: kafkaPort}, master ``master``) and broker 2
    (unreplicated), both with topic t's entries and map."""
    info = lambda r, port: json.dumps({"host": "127.0.0.1", "kafkaPort": port, "replicaId": r}).encode()  # noqa: E731
    nodes = {paths.group_replica(1, r): info(r, port) for r, port in members.items()}
    nodes[paths.group_state(1)] = GroupState(5, master, tuple((r, "%032x" % r) for r in isr), (0, 1, 2)).to_json()
    if master in members:
        nodes[paths.broker(1)] = info(master, members[master])
    nodes[paths.broker(2)] = info(0, 9300)
    nodes[paths.topic_entry("t", 1)] = json.dumps({"numPartitions": 1}).encode()
    nodes[paths.topic_entry("t", 2)] = json.dumps({"numPartitions": 1}).encode()
    nodes[paths.kafka_topic("t")] = TopicMap("t", ID_T, ("1-0", "2-0")).to_json()
    return nodes


def test_a_replicated_group_lists_every_member_and_leads_from_its_master():
    """Kafka clients keep the brokers Metadata lists: every live member is one, so when the master dies they
    still know members to ask (with one node per group, the dead master's address was all they had)."""
    paths = ZkPaths("/r")
    snap = build("clusterid-22-chars-abc", group_nodes(paths, 1, {0: 9200, 1: 9201, 2: 9202}), paths)
    m = readable(METADATA, km.metadata(snap, None))
    assert [(b["node_id"], b["port"]) for b in m["brokers"]] == [(1, 9200), (2, 9300), (1025, 9201), (2049, 9202)]
    assert m["controller_id"] == 2  # the master with the lowest node id
    parts = {p["partition_index"]: p for p in m["topics"][0]["partitions"]}
    assert (parts[0]["leader_id"], parts[0]["leader_epoch"], parts[0]["replica_nodes"], parts[0]["isr_nodes"],
            parts[0]["offline_replicas"]) == (1025, 5, [1, 1025, 2049], [1, 1025, 2049], [])
    assert (parts[1]["leader_id"], parts[1]["replica_nodes"], parts[1]["isr_nodes"]) == (2, [2], [2])
    coordinators = {km.find_coordinator(snap, [g], km.COORDINATOR_GROUP)[0]["node_id"] for g in map(str, range(40))}
    assert coordinators == {2, 1025}  # a group's coordinator is a master, never a replica

    # the master (member 1) died; member 0 not in sync: no leader until the group elects, members still listed
    snap = build("clusterid-22-chars-abc", group_nodes(paths, 1, {0: 9200, 2: 9202}, isr=(1, 2)), paths)
    m = readable(METADATA, km.metadata(snap, None))
    assert [b["node_id"] for b in m["brokers"]] == [1, 2, 2049]
    p = m["topics"][0]["partitions"][0]
    assert (p["error_code"], p["leader_id"], p["replica_nodes"], p["isr_nodes"], p["offline_replicas"]) == \
        (codes.LEADER_NOT_AVAILABLE, -1, [1, 1025, 2049], [], [1025])
