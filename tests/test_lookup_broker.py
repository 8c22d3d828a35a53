"""Lookups through brokers (``Lookup``: ``protocol/lookup.py``, ``server/lookup.py``, ``Consumer.lookup``):
real broker processes and ZooKeeper. Answers equal a full scan of the topic over two brokers, newest first
across partitions, through segment rolls and a restart; message ids; transactions by isolation; a topic
without a key index; bad input named; hostile requests refused; and ACLs: Read on the topic."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import wait_until
import cli
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.process import freeze
from metaq_broker.errors import InvalidQueryError
from metaq_broker.protocol import lookup as lookup_protocol
from metaq_broker.protocol.status import RemoteInvalidArgumentError, RemoteUnknownTopicError
from metaq_broker.store import PartitionLog, TopicConfig, lookup

TOPICS = {"orders": {"numPartitions": 2, "maxSegmentSize": 8192}, "plain": {"keyIndex": "false"}}


def scan(consumer, topic):
    """(store time, partition, offset, key, value) of every committed message: the adversary's answer."""
    rows = []
    for p, (start, end) in consumer.offsets(topic).items():
        t = consumer.read_range(topic, p, start, end).to_pydict()
        for o, k, v, ts in zip(t["offset"], t["key"], t["value"], t["timestamp"]):
            rows.append((ts, p, o, k, v))
    return rows


def newest_first(rows, key, n=64):
    hits = [r for r in rows if r[3] == key]
    hits.sort(key=lambda r: (-r[0].timestamp(), r[1], -r[2]))
    return [(r[1], r[2]) for r in hits][:n]


@pytest.fixture
def two_brokers(cluster):
    for b in (1, 2):
        cluster.start_broker(b, topics=TOPICS)
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 4, what="topic on both brokers")
        for i in range(60):
            producer.send_batch("orders", [b"v%d-%d" % (i, j) for j in range(20)],
                                keys=[b"order-%d" % ((i * 20 + j) % 13) for j in range(20)])
            producer.send_batch("orders", [b"to-1-0-%d" % i], keys=[b"order-1"], partition="1-0")
    return cluster


def test_key_lookups_equal_a_scan_across_brokers_partitions_and_segments(two_brokers):
    with two_brokers.client(Consumer) as consumer:
        rows = scan(consumer, "orders")
        for key in (b"order-1", b"order-7", b"order-12", b"none"):
            got = consumer.lookup("orders", key=key, max_messages=1000)
            assert [(m.partition, m.offset) for m in got] == newest_first(rows, key, 1000), key
            assert all(m.key == key and m.topic == "orders" for m in got)
        got = consumer.lookup("orders", key="order-1")  # str keys are UTF-8; 64 answers by default
        assert [(m.partition, m.offset) for m in got] == newest_first(rows, b"order-1")
        one = consumer.lookup("orders", key=b"order-1", partitions=["2-1"], max_messages=3)
        assert [(m.partition, m.offset) for m in one] == [(p, o) for p, o in newest_first(rows, b"order-1", 1000)
                                                           if p == "2-1"][:3]
        # a time range of store times
        table = consumer.lookup_arrow("orders", key=b"order-1", max_messages=1000)
        stores = sorted(set(table.column("storeTime").to_pylist()))
        since, until = stores[len(stores) // 4], stores[len(stores) // 2]
        ranged = consumer.lookup_arrow("orders", key=b"order-1", start_ms=since, end_ms=until, max_messages=1000)
        want = [(p, o) for p, o, t in zip(table.column("partition").to_pylist(), table.column("offset").to_pylist(),
                                          table.column("storeTime").to_pylist()) if since <= t <= until]
        assert list(zip(ranged.column("partition").to_pylist(), ranged.column("offset").to_pylist())) == want
        # by message id: the one message, on whichever broker holds it
        m = consumer.fetch("orders", "2-0", 5, max_messages=1).messages()[0]
        found = consumer.lookup("orders", msg_id=m.msg_id)
        assert [(x.partition, x.offset, x.value) for x in found if x.partition.startswith("2-")] == \
            [("2-0", 5, m.value)]
    # the sealed segments' indexes were written; after a restart the tail's is rebuilt from the log
    two_brokers.brokers[1].kill()
    two_brokers.start_broker(1, topics=TOPICS)
    with two_brokers.client(Consumer) as consumer:
        wait_until(lambda: len(consumer.cluster.topic_partitions("orders")) == 4, what="broker 1 back")
        for key in (b"order-1", b"order-5"):
            got = consumer.lookup("orders", key=key, max_messages=1000)
            assert [(m.partition, m.offset) for m in got] == newest_first(rows, key, 1000)


def test_a_reply_larger_than_a_fetch_goes_on_where_it_stopped(cluster):
    cluster.start_broker(1, settings={"maxTransferSize": 4096}, topics={"big": {"numPartitions": 2}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: len(producer.cluster.topic_partitions("big")) == 2, what="topic")
        for i in range(20):
            producer.send_batch("big", [b"x" * 1000] * 3, keys=[b"k", b"j", b"k"], partition=f"1-{i % 2}")
        rows = scan(consumer, "big")
        got = consumer.lookup("big", key=b"k", max_messages=35)
        assert [(m.partition, m.offset) for m in got] == newest_first(rows, b"k", 35)


def test_transactions_by_isolation_and_a_topic_without_a_key_index(cluster):
    cluster.start_broker(1, topics=TOPICS)
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("plain"), what="topic")
        producer.send_batch("orders", [b"committed"], keys=[b"k"], partition="1-0")
        txn = producer.transaction("lookup-test-1")
        txn.send_batch("orders", [b"open"], keys=[b"k"], partition="1-0")
        txn.prepare()  # durable now, so readers may see it: read_uncommitted ones
        assert [m.value for m in consumer.lookup("orders", key=b"k")] == [b"committed"]
        assert [m.value for m in consumer.lookup("orders", key=b"k", read_uncommitted=True)] == [b"open", b"committed"]
        txn.rollback()
        assert [m.value for m in consumer.lookup("orders", key=b"k", read_uncommitted=True)] == [b"committed"]
        producer.send_batch("plain", [b"v"], keys=[b"k"])
        with pytest.raises(RemoteInvalidArgumentError, match="topic plain keeps no key index .keyIndex=false."):
            consumer.lookup("plain", key=b"k")
        m = consumer.fetch("plain", "1-0", 0).messages()[0]
        assert [x.value for x in consumer.lookup("plain", msg_id=m.msg_id)] == [b"v"]


def test_bad_input_is_named(cluster):
    cluster.start_broker(1, topics=TOPICS)
    with cluster.client(Consumer) as consumer:
        wait_until(lambda: consumer.cluster.topic_partitions("orders"), what="topic")
        with pytest.raises(InvalidQueryError, match=r"start_ms \(2000 ms\) is after end_ms \(1000 ms\)"):
            consumer.lookup("orders", key=b"k", start_ms=2000, end_ms=1000)
        with pytest.raises(InvalidQueryError, match="give a key or a message id, one of them"):
            consumer.lookup("orders", key=b"k", msg_id=3)
        with pytest.raises(InvalidQueryError, match="max_messages must be an integer from 1 to 10000, got 0"):
            consumer.lookup("orders", key=b"k", max_messages=0)
        with pytest.raises(RemoteUnknownTopicError, match="unknown topic 'nope'"):
            consumer.lookup("nope", key=b"k", partitions=["1-0"])
        # the broker checks every field itself: a hostile client's requests
        call = lambda raw: consumer.call(1, lookup_protocol.PATH, raw)  # noqa: E731
        for raw, problem in ((b"\xff", "not JSON"), (b"[]", "not a JSON object"),
                             (b'{"topic": "orders", "key": "a2V5", "sql": 1}', "unknown field 'sql'"),
                             (b'{"topic": "orders", "key": "!!"}', "key is not base64"),
                             (b'{"topic": "orders"}', "give a key or a message id"),
                             (b'{"topic": "orders", "msg_id": true}', "msg_id must be an integer"),
                             (b'{"topic": "orders", "key": "", "max": 100000}', "max must be an integer from 1"),
                             (b'{"topic": "orders", "key": "", "partitions": [0, 0]}', "distinct"),
                             (b'{"topic": "orders", "key": "", "before": {"x": 1}}', "before must map"),
                             (b'{"topic": "orders", "key": "", "from": {"0": -1}}', "from must map"),
                             (json.dumps({"topic": "orders", "key": "", "since_ms": 5, "until_ms": 1}).encode(),
                              r"since \(5 ms\) is after until \(1 ms\)"),
                             (b'{"topic": "orders", "key": "", "isolation": "dirty"}', "isolation must be")):
            with pytest.raises(RemoteInvalidArgumentError, match=problem):
                call(raw)


metaq = cli.metaq_on


def test_metaq_lookup_prints_as_consume_does(cluster):
    cluster.start_broker(1, topics=TOPICS)
    with cluster.client(Producer) as producer:
        wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic")
        for i in range(30):
            producer.send_batch("orders", [b"v%d" % i, b"w%d" % i], keys=[b"order-4711", b"other"], partition="1-1")
    r = metaq(cluster, "lookup", "orders", "--key", "order-4711", "--max", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [b"v29", b"v28", b"v27"]
    r = metaq(cluster, "lookup", "orders", "--key", "order-4711", "--max", "1", "--format", "json")
    row = json.loads(r.stdout)
    assert (row["partition"], row["offset"], row["key"], row["value"], row["timestampType"]) == \
        ("1-1", 58, "order-4711", "v29", "LogAppendTime")
    r = metaq(cluster, "lookup", "orders", "--msg-id", str(row["msgId"]), "--format", "json")
    assert [json.loads(line)["offset"] for line in r.stdout.splitlines()] == [58]
    r = metaq(cluster, "lookup", "orders", "--key", "order-4711", "--since", "2024-05-02T00:00:00",
              "--until", "2024-05-01T00:00:00")
    assert r.returncode == 1 and b"is after end_ms" in r.stderr and b"start_ms" in r.stderr
    r = metaq(cluster, "lookup", "orders", "--key", "nobody")
    assert r.returncode == 0 and r.stdout == b""
    r = metaq(cluster, "lookup", "orders")
    assert r.returncode == 2 and b"give --key or --msg-id, one of them" in r.stderr
    r = metaq(cluster, "lookup", "plain", "--key", "k")
    assert r.returncode == 1 and b"keeps no key index (keyIndex=false)" in r.stderr
    r = metaq(cluster, "lookup", "orders", "--key", "k", "--since", "yesterday")
    assert r.returncode == 2 and b"'yesterday' is neither ms since the epoch nor an ISO 8601" in r.stderr


def test_metaq_log_reindex_rebuilds_lost_and_damaged_key_indexes(cluster):
    cluster.start_broker(1, topics=TOPICS)
    with cluster.client(Producer) as producer:
        wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic")
        for i in range(40):
            producer.send_batch("orders", [b"x" * 200] * 5, keys=[b"k%d" % (i % 4)] * 5, partition="1-0")
    cluster.brokers[1].stop()
    part = cluster.brokers[1].workdir / "data" / "orders-0"
    keys = sorted(part.glob("*.keys"))  # every segment's: the last one's too, written as the broker stopped
    assert len(keys) == len(list(part.glob("*.meta"))) >= 3
    keys[0].unlink()
    raw = bytearray(keys[1].read_bytes())
    raw[-3] ^= 1
    keys[1].write_bytes(bytes(raw))
    r = metaq(cluster, "log", "verify", str(part))
    assert r.returncode == 1 and f"{keys[1]} fails its checksums".encode() in r.stderr
    r = metaq(cluster, "log", "describe", str(part))
    assert r.returncode == 0 and f"key index: {len(keys) - 2} of {len(keys) - 1} sealed".encode() in r.stdout
    r = metaq(cluster, "log", "reindex", str(part))
    assert r.returncode == 0 and b"key indexes of" in r.stdout, r.stderr
    assert keys[0].exists()
    r = metaq(cluster, "log", "verify", str(part))
    assert r.returncode == 0, r.stderr
    cluster.start_broker(1, topics=TOPICS)
    with cluster.client(Consumer) as consumer:
        wait_until(lambda: consumer.cluster.topic_partitions("orders"), what="broker back")
        assert [m.offset for m in consumer.lookup("orders", key=b"k1", partitions=["1-0"], max_messages=1000)] == \
            [o for i in range(39, -1, -1) if i % 4 == 1 for o in range(5 * i + 4, 5 * i - 1, -1)]


def test_a_truncated_replica_answers_as_its_log_after_taking_over(tmp_path, zookeeper, zk_root):
    """Keyed acks=1 puts reach only the master (its replicas frozen), it dies, a replica takes over and
    takes more under the same key; the old master comes back and truncates what nobody else had (across
    segment rolls). Then it takes over itself: its lookups, from the key indexes it cut and went on
    building, equal a scan of its log and never name a cut message; every member's data directory agrees."""
    topics = {"orders": {"numPartitions": 1, "maxSegmentSize": 4096}}
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3, topics=topics).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(3))
        others = [r for r in range(3) if r != first]
        z = dict(zk_connect=group.zk_connect, zk_root=group.paths.root)
        with Producer(timeout=20.0, **z) as producer, Consumer(**z) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic routed")
            for i in range(30):
                producer.send_batch("orders", [b"common-%d" % i] * 3, keys=[b"k", b"j", b"k"])
            for r in others:
                freeze(group.members[r].proc.pid)
            time.sleep(1.5)  # fetches in flight are answered before the puts below
            with Producer(acks="1", timeout=5.0, **z) as fast:
                for i in range(30):
                    fast.send_batch("orders", [b"lost-%d" % i] * 3, keys=[b"k", b"lost", b"k"])
            group.members[first].kill()
            for r in others:
                os.kill(group.members[r].proc.pid, signal.SIGCONT)
            second = group.wait_master(timeout=30, other_than=first)
            wait_until(lambda: producer.cluster.brokers().get(1) == group.members[second].address, what="new master")
            for i in range(10):
                producer.send_batch("orders", [b"new-%d" % i] * 2, keys=[b"k", b"j"])
            group.members[first].start()
            group.wait_in_sync(range(3))
            assert "truncated" in group.members[first].log_path.read_text()
            for r in range(3):  # the old master alone is left: it takes over
                if r != first:
                    group.members[r].kill()
            group.wait_master(timeout=30, other_than=second)
            wait_until(lambda: producer.cluster.brokers().get(1) == group.members[first].address, what="old master")
            rows = scan(consumer, "orders")
            for key in (b"k", b"j", b"lost"):
                got = consumer.lookup("orders", key=key, max_messages=1000)
                assert [(m.partition, m.offset) for m in got] == newest_first(rows, key, 1000), key
                assert not any(m.value.startswith(b"lost-") for m in got)
            assert len(newest_first(rows, b"k", 1000)) == 2 * 30 + 10
    finally:
        group.stop()
    for member in group.members:  # each directory, opened as it was left: its indexes agree with its log
        log = PartitionLog.open(member.workdir / "data" / "orders-0", "orders", 0, TopicConfig(max_segment_size=4096))
        try:
            assert not log.verify()
            assert [o for o in lookup.by_key(log, b"lost").offsets] == []
            assert len(lookup.by_key(log, b"k", max_answers=1000).offsets) == 70
        finally:
            log.close()
