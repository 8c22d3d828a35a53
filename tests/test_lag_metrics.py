"""Consumer-group lag exported by a real broker's /metrics (``metaq_consumergroup_lag`` and
``_lag_seconds``), against offsets committed in a real ZooKeeper; and the offset watcher behind them
reading ZooKeeper only where something changed."""
import time
import urllib.request

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk.group_offsets import GroupOffsetWatcher, GroupStore
from metaq_broker.zk.paths import ZkPaths

LAG, LAG_S = "metaq_consumergroup_lag", "metaq_consumergroup_lag_seconds"


def scrape(port) -> dict:
    """{(name, ((label, value), ...)): value} of the group-lag samples, and the time it was taken between."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name in (LAG, LAG_S)}


def key(name, group, topic, partition):
    return name, (("group", group), ("partition", partition), ("topic", topic))


@pytest.fixture
def broker(tmp_path, zookeeper, zk_root):
    overrides = {"brokerId": 1, "serverPort": 0, "kafkaPort": 0, "metricsPort": 0, "zk.connect": zookeeper.connect_string,
                 "zk.root": zk_root, "dataPath": tmp_path / "b"}
    b = Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()
    yield b
    b.stop()


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(15)
    yield client
    client.stop()
    client.close()


def test_lag_in_offsets_and_seconds_follows_commits(broker, zk, zk_root, zookeeper):
    broker.create_topic("orders", 2, {})
    conn = dict(zk_connect=zookeeper.connect_string, zk_root=zk_root)
    with Producer(**conn) as producer, Consumer(**conn) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic in ZooKeeper")
        producer.send_batch("orders", [b"a%d" % i for i in range(10)], partition="1-0")
        time.sleep(0.3)  # so the two batches' store times differ
        producer.send_batch("orders", [b"b%d" % i for i in range(5)], partition="1-0")
        producer.send_batch("orders", [b"c%d" % i for i in range(4)], partition="1-1")
        stamps = {m.offset: m.timestamp.timestamp() for m in consumer.fetch("orders", "1-0", 0).messages()}
    assert len(stamps) == 15 and stamps[12] > stamps[3]
    port = broker.metrics_port
    assert scrape(port) == {}  # no group has committed yet

    groups = GroupStore(zk, zk_root)
    groups.commit("app", "orders", {"1-0": 12, "1-1": 4})
    groups.commit("other-broker", "orders", {"2-0": 3})  # partitions of broker 2: not this broker's to report
    m = wait_until(lambda: (lambda m: len(m) == 4 and m)(scrape(port)), what="the group's lag")
    before = time.time()
    m = scrape(port)
    after = time.time()
    assert m[key(LAG, "app", "orders", "1-0")] == 15 - 12 and m[key(LAG, "app", "orders", "1-1")] == 0
    assert m[key(LAG_S, "app", "orders", "1-1")] == 0  # caught up
    # Offset 12 is in the second batch: its store time, not the first batch's.
    assert before - stamps[12] - 0.001 <= m[key(LAG_S, "app", "orders", "1-0")] <= after - stamps[12] + 0.001

    groups.commit("app", "orders", {"1-0": 3})  # backwards (a reset): in the first batch
    groups.commit("late", "orders", {"1-1": 1})
    wait_until(lambda: (lambda m: m.get(key(LAG, "app", "orders", "1-0")) == 12
                        and key(LAG, "late", "orders", "1-1") in m)(scrape(port)), what="new offsets")
    before = time.time()
    m = scrape(port)
    after = time.time()
    assert before - stamps[3] - 0.001 <= m[key(LAG_S, "app", "orders", "1-0")] <= after - stamps[3] + 0.001
    assert m[key(LAG, "late", "orders", "1-1")] == 3

    groups.commit("app", "orders", {"1-0": 15})
    groups.delete("late")
    m = wait_until(lambda: (lambda m: m.get(key(LAG, "app", "orders", "1-0")) == 0 and len(m) == 4 and m)(
        scrape(port)), what="caught up, and the deleted group gone")
    assert m[key(LAG_S, "app", "orders", "1-0")] == 0
    assert {labels for _, labels in m} == {key(LAG, "app", "orders", p)[1] for p in ("1-0", "1-1")}


def test_lag_counts_to_the_last_stable_offset(broker, zk, zk_root, zookeeper):
    broker.create_topic("t", 1, {})
    conn = dict(zk_connect=zookeeper.connect_string, zk_root=zk_root)
    with Producer(**conn) as producer:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic in ZooKeeper")
        producer.send_batch("t", [b"x"] * 5, partition="1-0")
        txn = producer.transaction("lag-test")
        txn.send_batch("t", [b"y"] * 3, partition="1-0")  # open: the last stable offset stays at 5
        producer.send_batch("t", [b"z"], partition="1-0")  # 8: its fsync publishes the log end past both
        GroupStore(zk, zk_root).commit("g", "t", {"1-0": 2})
        m = wait_until(lambda: (lambda m: m and m)(scrape(broker.metrics_port)), what="lag")
        assert broker.store.partition("t", 0).visible_end == 9
        assert m[key(LAG, "g", "t", "1-0")] == 3
        txn.rollback()


def test_the_watcher_reads_zookeeper_only_where_something_changed(zk, zk_root, zookeeper):
    groups, paths = GroupStore(zk, zk_root), ZkPaths(zk_root)
    own = KazooClient(hosts=zookeeper.connect_string)  # the watcher's: every request it sends is recorded
    own.start(15)
    reads = []
    for name in ("get_async", "get_children_async", "exists_async"):  # kazoo's synchronous calls use these
        real = getattr(own, name)
        setattr(own, name, lambda *a, _real=real, _name=name, **kw: (reads.append((_name, a[0])), _real(*a, **kw))[1])
    try:
        check_watcher(GroupOffsetWatcher(own, zk_root, 1), own, groups, paths, reads)
    finally:
        own.stop()
        own.close()


def check_watcher(watcher, own, groups, paths, reads):
    assert watcher.offsets() == {}  # no consumers node yet: watched for its creation
    groups.join("members-only", "c1", ["t"])  # a group with members and no offsets yet
    groups.commit("a", "t", {f"1-{n}": n for n in range(50)} | {"2-0": 7})
    groups.commit("a", "u", {"1-0": 1})
    want = {("a", "t", f"1-{n}"): n for n in range(50)} | {("a", "u", "1-0"): 1}
    wait_until(lambda: watcher.offsets() == want, what="first offsets")
    reads.clear()
    for _ in range(5):
        assert watcher.offsets() == want
    assert reads == []  # nothing changed: no request at all

    for i in range(20):  # many commits of one partition between two reads: one read
        groups.commit("a", "t", {"1-7": 100 + i})
    want[("a", "t", "1-7")] = 119
    wait_until(lambda: watcher.offsets() == want, what="the new offset")
    assert [r for r in reads if r[0] == "get_async"] == [("get_async", paths.group_offset("a", "t", "1-7"))]
    assert not [r for r in reads if r[1].endswith("/1-8")]

    reads.clear()
    groups.commit("members-only", "t", {"1-0": 5})  # created below a node that did not exist
    want[("members-only", "t", "1-0")] = 5
    wait_until(lambda: watcher.offsets() == want, what="a group's first commit")
    assert len(reads) < 10
    groups.zk.set(paths.group_offset("a", "u", "1-0"), b"not a number")
    want[("a", "u", "1-0")] = -1
    wait_until(lambda: watcher.offsets() == want, what="a foreign value")
    groups.delete("a")
    wait_until(lambda: watcher.offsets() == {("members-only", "t", "1-0"): 5}, what="the group deleted")

    own.restart()  # a new session: its watches are gone, so everything is read again
    groups.commit("b", "t", {"1-0": 9})
    wait_until(lambda: watcher.offsets() == {("members-only", "t", "1-0"): 5, ("b", "t", "1-0"): 9},
               what="offsets after a new session")
