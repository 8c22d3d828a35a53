"""Kafka's partition numbers and topic ids in ZooKeeper (zk/kafka_partitions.py), the watch-driven cluster cache
(zk/kafka_cluster.py) and Metadata built from it, against a real ZooKeeper: numbering is append-only (a number
keeps its partition and is never reused: brokers joining, leaving, being forgotten, growing a topic), brokers
racing to number the same topic (threads with their own sessions, and real broker processes starting at
once) never lose or renumber a partition, a damaged map is refused and left as it is, the cluster id is made
once, and the cache follows registrations, topic entries, group epochs and maps by watches."""
import json
import threading

import pytest
from conftest import wait_until
from kazoo.client import KazooClient

from metaq_broker.errors import MetaqError
from metaq_broker.protocol.kafka import codes
from metaq_broker.server import kafka_metadata as km
from metaq_broker.server.registration import BrokerRegistration
from metaq_broker.zk import kafka_partitions, topic_entries
from metaq_broker.zk.groups import GroupState
from metaq_broker.zk.kafka_cluster import KafkaBroker, KafkaClusterCache
from metaq_broker.zk.kafka_partitions import KafkaMapError, TopicMap, uuid_from_str, uuid_to_str
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit


def test_uuid_strings_are_kafkas():
    raw = bytes.fromhex("5a1f0c8c2b3e4f6a9d7e1b2c3d4e5f60")
    assert uuid_to_str(raw) == "Wh8MjCs-T2qdfhssPU5fYA" and uuid_from_str("Wh8MjCs-T2qdfhssPU5fYA") == raw
    for bad in ("", "short", "Wh8MjCs-T2qdfhssPU5fY=", "Wh8MjCs-T2qdfhssPU5fYAA", None, "Wh8MjCs+T2qdfhssPU5fYA"):
        with pytest.raises(ValueError, match="Kafka UUID"):
            uuid_from_str(bad)


def test_numbers_are_appended_and_never_move(zk_clients):
    make, paths = zk_clients
    zk = make()
    assert kafka_partitions.read(zk, paths, "t") is None
    m = kafka_partitions.number(zk, paths, "t", ["2-1", "2-0", "10-0", "2-10", "2-2"])
    assert m.partitions == ("2-0", "2-1", "2-2", "2-10", "10-0")  # by (broker, n), not as strings
    assert len(m.topic_id) == 16 and m.version == 0
    again = kafka_partitions.number(zk, paths, "t", ["2-0"])
    assert again == m and again.version == 0  # nothing to add: nothing written
    grown = kafka_partitions.number(zk, paths, "t", ["1-0", "2-0", "2-3"])
    assert grown.partitions == m.partitions + ("1-0", "2-3") and grown.topic_id == m.topic_id
    assert (grown.number_of("1-0"), grown.name_of(5), grown.name_of(7), grown.name_of(-1)) == (5, "1-0", None, None)
    stored = json.loads(zk.get(paths.kafka_topic("t"))[0])
    assert stored == {"version": 1, "topicId": uuid_to_str(m.topic_id), "partitions": list(grown.partitions)}
    other = kafka_partitions.number(zk, paths, "u", ["2-0"])
    assert other.topic_id != m.topic_id and other.partitions == ("2-0",)


def test_brokers_numbering_at_once_never_lose_or_renumber(zk_clients):
    make, paths = zk_clients
    workers, results, errors = 8, {}, []
    start = threading.Barrier(workers)

    def broker(b):
        zk = make()
        try:
            start.wait()
            seen = []
            for n in range(6):  # partitions appear one by one (a topic growing), some shared
                seen.append(kafka_partitions.number(zk, paths, "race", [f"{b}-{n}", f"{(b + 1) % workers}-{n}"]))
            results[b] = seen
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=broker, args=(b,)) for b in range(workers)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors
    final = kafka_partitions.read(make(), paths, "race")
    assert sorted(final.partitions) == sorted(f"{b}-{n}" for b in range(workers) for n in range(6))
    assert len(set(final.partitions)) == len(final.partitions)
    ids = {m.topic_id for seen in results.values() for m in seen}
    assert ids == {final.topic_id}  # one topic id, whoever created the node
    for seen in results.values():
        for m in seen:  # every map any broker saw is a prefix of the final one: no number ever moved
            assert final.partitions[:len(m.partitions)] == m.partitions


def test_a_damaged_map_is_refused_and_left_alone(zk_clients):
    make, paths = zk_clients
    zk = make()
    for data in (b"not json", b'{"version": 2}', b'{"version": 1, "topicId": "x", "partitions": []}',
                 json.dumps({"version": 1, "topicId": uuid_to_str(bytes(16)), "partitions": ["1-0", "1-0"]}).encode(),
                 json.dumps({"version": 1, "topicId": uuid_to_str(bytes(16)), "partitions": ["01-0"]}).encode()):
        zk.create(paths.kafka_topic("bad"), data, makepath=True)
        with pytest.raises(KafkaMapError, match="partition map of topic 'bad' is damaged"):
            kafka_partitions.number(zk, paths, "bad", ["1-1"])
        assert zk.get(paths.kafka_topic("bad"))[0] == data
        zk.delete(paths.kafka_topic("bad"))


def test_the_cluster_id_is_made_once(zk_clients):
    make, paths = zk_clients
    got, start = [], threading.Barrier(6)

    def ask():
        zk = make()
        start.wait()
        got.append(kafka_partitions.cluster_id(zk, paths))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert len(got) == 6 and len(set(got)) == 1 and len(uuid_from_str(got[0])) == 16
    zk = make()
    zk.set(paths.kafka_cluster_id(), b"{}")
    with pytest.raises(KafkaMapError, match="is not a cluster id"):
        kafka_partitions.cluster_id(zk, paths)


# -- registration numbers, the cache follows -----------------------------------------------------------
def register(zookeeper, root, broker_id, topics, kafka_port=9090):
    address = {"host": f"b{broker_id}.test", "port": 8000 + broker_id, "brokerId": broker_id}
    if kafka_port:
        address["kafkaPort"] = kafka_port + broker_id
    return BrokerRegistration(zookeeper.connect_string, root, broker_id, address, topics, session_timeout=4.0).start()


def test_registration_numbers_and_metadata_follows_brokers_joining_leaving_and_forgotten(zookeeper, zk_root, zk_clients):
    make, paths = zk_clients
    zk = make()
    r1 = register(zookeeper, zk_root, 1, {"t": 2})
    cache = KafkaClusterCache(zk, zk_root)
    changes = []
    cache.on_change(lambda: changes.append(1))
    regs = [r1]
    try:
        assert kafka_partitions.read(zk, paths, "t").partitions == ("1-0", "1-1")
        snap = wait_until(lambda: (s := cache.snapshot()).maps.get("t") and s, what="the cache has t")
        assert snap.brokers == {1: KafkaBroker(1, "b1.test", 9091)} and snap.topics == {"t": {1: 2}}
        assert snap.cluster_id == kafka_partitions.cluster_id(zk, paths) and cache.snapshot() is snap  # no change
        regs.append(register(zookeeper, zk_root, 2, {"t": 1, "u": 1}))  # a broker joins
        wait_until(lambda: cache.snapshot().maps["t"].partitions == ("1-0", "1-1", "2-0"), what="2-0 numbered")
        assert changes

        def leaders():
            return [(p["partition_index"], p["leader_id"], p["error_code"])
                    for p in km.topic_entry(cache.snapshot(), "t")["partitions"]]

        wait_until(lambda: leaders() == [(0, 1, 0), (1, 1, 0), (2, 2, 0)], what="all led")
        regs.pop().stop()  # broker 2 stops: its partition stays, offline
        wait_until(lambda: leaders() == [(0, 1, 0), (1, 1, 0), (2, -1, codes.LEADER_NOT_AVAILABLE)], what="2 down")
        topic_entries.delete(zk, paths, "t", 2)  # metaq brokers --forget 2
        wait_until(lambda: 2 not in cache.snapshot().topics["t"], what="entry gone")
        assert leaders() == [(0, 1, 0), (1, 1, 0), (2, -1, codes.LEADER_NOT_AVAILABLE)]  # the number stays
        r1.add_topic("t", 3)  # a broker grows the topic
        regs.append(register(zookeeper, zk_root, 2, {"t": 2}))  # broker 2 is back, with more partitions
        wait_until(lambda: leaders() == [(0, 1, 0), (1, 1, 0), (2, 2, 0), (3, 1, 0), (4, 2, 0)], what="renumbered?")
        assert cache.snapshot().maps["t"].partitions == ("1-0", "1-1", "2-0", "1-2", "2-1")
        zk.create(paths.group_state(1), GroupState(5, 0, ((0, "a" * 32),), (0,)).to_json(), makepath=True)
        wait_until(lambda: cache.snapshot().epochs.get(1) == 5, what="epoch")
        assert km.topic_entry(cache.snapshot(), "t")["partitions"][0]["leader_epoch"] == 5
        zk.set(paths.kafka_topic("u"), b"damaged")  # a damaged map is left out (and logged), the rest stays
        wait_until(lambda: "u" not in cache.snapshot().maps, what="u left out")
        assert "t" in cache.snapshot().maps
    finally:
        cache.close()
        for r in regs:
            r.stop()


def test_a_damaged_map_does_not_stop_registration(zookeeper, zk_root, zk_clients):
    make, paths = zk_clients
    zk = make()
    zk.create(paths.kafka_topic("t"), b"damaged", makepath=True)
    r = register(zookeeper, zk_root, 3, {"t": 1})
    try:
        assert zk.exists(paths.broker(3)) and zk.exists(paths.topic_entry("t", 3))
        assert zk.get(paths.kafka_topic("t"))[0] == b"damaged"
    finally:
        r.stop()


def test_topic_map_checks():
    m = TopicMap("t", b"\x01" * 16, ("1-0", "2-0"))
    assert TopicMap.from_json("t", m.to_json(), 4) == TopicMap("t", b"\x01" * 16, ("1-0", "2-0"), 4)
    with pytest.raises(MetaqError):
        TopicMap.from_json("t", b'{"version": 1, "topicId": "AQEBAQEBAQEBAQEBAQEBAQ", "partitions": "1-0"}')


def test_real_brokers_starting_at_once_number_their_partitions(cluster):
    """Three broker processes start together with the same topic: each numbers its own partitions."""
    errors = []

    def start(b):
        try:
            cluster.start_broker(b, topics={"orders": {"numPartitions": 2}})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start, args=(b,)) for b in (1, 2, 3)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors
    zk = KazooClient(cluster.zk_connect)
    zk.start(10)
    try:
        m = kafka_partitions.read(zk, ZkPaths(cluster.zk_root), "orders")
        assert sorted(m.partitions) == ["1-0", "1-1", "2-0", "2-1", "3-0", "3-1"]
        for b in (1, 2, 3):  # each broker's partitions were appended together, in order
            k = m.number_of(f"{b}-0")
            assert m.name_of(k + 1) == f"{b}-1"
        cluster.brokers[2].kill()
        cluster.start_broker(2, topics={"orders": {"numPartitions": 3}})  # restarted with a partition more
        again = kafka_partitions.read(zk, ZkPaths(cluster.zk_root), "orders")
        assert again.partitions == m.partitions + ("2-2",) and again.topic_id == m.topic_id
    finally:
        zk.stop()
        zk.close()
