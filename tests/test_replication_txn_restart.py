"""Issue 24, defect 9: acknowledged transactional writes hidden after a restart (a single broker, no
replication). A transaction whose decision is recorded is settled at once when its broker is back (the
resolver's first round no longer waits), and a commit is answered only after the older in-doubt
transactions of its partitions whose decision is recorded are settled too, so a read planned after it
sees it; Spark batch writes across kill -9 cycles of the broker, each read planned at once after save()."""
import json
import threading
import time

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.zk import decisions as txn_decisions


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(10)
    yield client
    client.stop()
    client.close()


def start(cluster):
    return cluster.start_broker(1, settings={"transactionTimeout": 600_000}, topics={"t": {"numPartitions": 2}})


def read_now(cluster, partition="1-0") -> list:
    """What a read planned now sees of a partition (up to its last stable offset)."""
    with cluster.client(Consumer) as c:
        earliest, latest = c.offsets("t", [partition])[partition]
        return c.read_range("t", partition, earliest, latest).column("value").to_pylist() if latest > earliest else []


def in_doubt(cluster, batch: str, path: str):
    """A prepared transaction of 'batch' naming the decision record ``path``; returns its [[bid, xid]]."""
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        t = p.transaction(f"s/{batch}/r/0/0", coordinator=json.dumps({"path": path, "run": "r"}))
        t.send_batch("t", [b"in-doubt-%s" % batch.encode()], partition="1-0")
        return t.prepare()


def test_a_commit_is_answered_after_the_decided_in_doubt_transactions_ahead_of_it(cluster, zk):
    """T0 is prepared and its writer recorded "commit" but never sent it (its driver died, or its broker
    was down then); T1, after it in the same partition, is committed by its writer. Once T1's commit is
    answered, a read planned at once sees T1: T0 was settled first. It used to stay in doubt until the
    resolver's next round (seconds after a restart), and T1 with it, behind the last stable offset."""
    start(cluster)
    first = f"{cluster.zk_root}/sinks/s/batches/0"
    xids = in_doubt(cluster, "0", first)
    with cluster.client(Producer) as p:
        t1 = p.transaction("other/1/r/0/0", coordinator=json.dumps({"path": f"{cluster.zk_root}/sinks/other/batches/1",
                                                                     "run": "r"}))
        t1.send_batch("t", [b"t1"], partition="1-0")
        t1_xids = t1.prepare()
        assert read_now(cluster) == []  # T0 holds the last stable offset
        txn_decisions.decide_commit(zk, first, "r", xids)
        txn_decisions.decide_commit(zk, f"{cluster.zk_root}/sinks/other/batches/1", "r", t1_xids)
        t1.commit()
        assert read_now(cluster) == [b"in-doubt-0", b"t1"]


def test_a_decided_transaction_is_settled_when_its_broker_is_back(cluster, zk):
    """The decision is recorded while the broker is down (kill -9): restarted, it settles the transaction
    from the record in its first resolver round, which runs at once."""
    broker = start(cluster)
    path = f"{cluster.zk_root}/sinks/s/batches/3"
    xids = in_doubt(cluster, "3", path)
    broker.kill()
    txn_decisions.decide_commit(zk, path, "r", xids)
    broker = cluster.start_broker(1, settings=broker.settings, topics=broker.topics)
    with cluster.client(Admin) as admin:
        wait_until(lambda: not admin.prepared_transactions(1), timeout=5, what="the decided transaction settled")
    assert read_now(cluster) == [b"in-doubt-3"]
    assert "committing in-doubt transaction s/3/r/0/0@1" in broker.log_path.read_text()


def test_spark_batch_writes_across_broker_restarts_are_seen_by_a_read_planned_at_once(spark, cluster, zk):
    """Batch writes one after another while the broker is killed (kill -9) just as a write's driver has
    recorded its decision, three times: a read planned right after each save() returns sees every row of
    every write acknowledged so far. (A decision recorded and settled between two polls of the watcher is
    not caught; the writes go on until three were.)"""
    from spark_helpers import reader
    broker = start(cluster)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
    armed, kills = threading.Event(), []
    stop = threading.Event()

    def decided(root, sink) -> bool:
        try:
            return bool(zk.get_children(f"{root}/{sink}/batches"))
        except NoNodeError:  # not recorded yet, or recorded and settled since the listing
            return False

    def kill_at_the_decision():
        seen = set()
        while not stop.is_set():
            root = f"{cluster.zk_root}/sinks"
            for sink in zk.get_children(root) if zk.exists(root) else []:
                if sink not in seen and decided(root, sink):
                    seen.add(sink)
                    if armed.is_set():
                        armed.clear()
                        cluster.brokers[1].kill()
                        kills.append(sink)
                        cluster.start_broker(1, settings=broker.settings, topics=broker.topics)
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_at_the_decision, daemon=True)
    watcher.start()
    acknowledged, n = 0, 0
    try:
        while len(kills) < 3:  # a decision the watcher polled past (a busy machine) arms the next write too
            assert n < 15 and watcher.is_alive(), f"the watcher caught {len(kills)} decisions in {n} writes " \
                                                  f"(running: {watcher.is_alive()})"
            if n % 2 == 1:
                armed.set()
            df = spark.range(n * 500, (n + 1) * 500, numPartitions=2).selectExpr("cast(id as string) as value")
            df.write.format("metaq").option("metaq.zk.connect", cluster.zk_connect) \
                .option("metaq.zk.root", cluster.zk_root).option("topic", "t").mode("append").save()
            acknowledged += 500
            seen = reader(spark, cluster, subscribe="t").count()
            assert seen == acknowledged, f"write {n}: {acknowledged} rows acknowledged, a read planned at once saw {seen}"
            n += 1
    finally:
        stop.set()
        watcher.join(timeout=60)
