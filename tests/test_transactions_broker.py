"""Broker transactions through real broker processes, the client and a real ZooKeeper: invisible until
commit, durable prepare across a SIGKILL, and in-doubt transactions settled by their decision record."""
import json
import time

import pytest
from conftest import wait_until
from kazoo.client import KazooClient

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol.status import RemoteTransactionError
from metaq_broker.zk import decisions as txn_decisions


def visible(cluster, topic, partition):
    with cluster.client(Consumer, group="peek") as c:
        latest = c.offsets(topic, [partition])[partition][1]
        return [v.as_py() for v in c.read_range(topic, partition, 0, latest).column("value")] if latest else []


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(10)
    yield client
    client.stop()
    client.close()


def start(cluster, timeout_ms=60_000):
    return cluster.start_broker(1, settings={"transactionTimeout": timeout_ms},
                                topics={"t": {"numPartitions": 2}})


def test_commit_makes_messages_visible_rollback_never(cluster):
    start(cluster)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        txn = p.transaction("job/1")
        txn.send_batch("t", [b"a", b"b"], partition="1-0")
        txn.send_batch("t", [b"c"], partition="1-1")
        p.send_batch("t", [b"plain"], partition="1-0")
        # The open transaction holds readers back at its first offset (the last stable offset), so the
        # plain message written after it waits too (Kafka's read_committed).
        assert visible(cluster, "t", "1-0") == []
        assert txn.prepare() == [[1, "job/1@1"]]
        assert visible(cluster, "t", "1-0") == [] and visible(cluster, "t", "1-1") == []
        txn.commit()
        txn.commit()  # idempotent
        assert visible(cluster, "t", "1-0") == [b"a", b"b", b"plain"] and visible(cluster, "t", "1-1") == [b"c"]

        gone = p.transaction("job/2")
        gone.send_batch("t", [b"never"], partition="1-1")
        gone.prepare()
        gone.rollback()
        gone.rollback()
        assert visible(cluster, "t", "1-1") == [b"c"]
        with pytest.raises(RemoteTransactionError, match="rolled back"):
            p.connection(1).call("CommitTransaction", pb.TransactionRequest(xid="job/2@1"))
        with pytest.raises(RemoteTransactionError, match="unknown transaction 'nope'"):
            p.connection(1).call("PrepareTransaction", pb.TransactionRequest(xid="nope"))
        with pytest.raises(RemoteTransactionError, match="coordinator must be JSON"):
            p.connection(1).call("BeginTransaction", pb.BeginTransactionRequest(xid="x", coordinator="{"))
        with pytest.raises(RemoteTransactionError, match=r"timeout of 900001 ms exceeds the broker's "
                                                         r"transactionMaxTimeout \(900000 ms\)"):
            p.connection(1).call("BeginTransaction", pb.BeginTransactionRequest(xid="y", timeout_ms=900_001))


def test_prepared_survives_a_broker_crash(cluster):
    broker = start(cluster)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        txn = p.transaction("crash")
        txn.send_batch("t", [b"x%d" % i for i in range(100)], partition="1-0")
        txn.prepare()
        open_one = p.transaction("open")
        open_one.send_batch("t", [b"lost"], partition="1-1")
    broker.kill()
    start(cluster)
    with cluster.client(Admin) as admin:
        wait_until(lambda: 1 in admin.masters(), what="broker back")
        [prepared] = admin.prepared_transactions(1)
        assert (prepared.xid, prepared.messages) == ("crash@1", 100)
    assert visible(cluster, "t", "1-0") == []
    with cluster.client(Producer) as p:
        with pytest.raises(RemoteTransactionError, match="unknown transaction"):
            open_one.producer = p
            open_one.prepare()
        txn.producer = p
        txn.commit()
    assert visible(cluster, "t", "1-0") == [b"x%d" % i for i in range(100)]


def test_in_doubt_transactions_follow_their_decision_record(cluster, zk):
    start(cluster, timeout_ms=1000)
    path = f"{cluster.zk_root}/sinks/s1/batches/7"
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        coordinator = json.dumps({"path": path, "run": "r1"})
        winner = p.transaction("s1/7/r1/0/0", coordinator=coordinator)
        winner.send_batch("t", [b"win"], partition="1-0")
        loser = p.transaction("s1/7/r1/0/1", coordinator=coordinator)  # a failed attempt's leftovers
        loser.send_batch("t", [b"lose"], partition="1-0")
        xids = winner.prepare()
        loser.prepare()
        # The writer decides and then "crashes" before committing: the broker finishes the job.
        txn_decisions.decide_commit(zk, path, "r1", xids)
        with cluster.client(Admin) as admin:
            wait_until(lambda: not admin.prepared_transactions(1), timeout=15, what="in-doubt settled")
        assert visible(cluster, "t", "1-0") == [b"win"]

        # No decision at all: after transactionTimeout the broker records an abort and rolls back, and
        # a late writer of that run can no longer commit.
        late_path = f"{cluster.zk_root}/sinks/s1/batches/8"
        late = p.transaction("s1/8/r2/0/0", coordinator=json.dumps({"path": late_path, "run": "r2"}))
        late.send_batch("t", [b"late"], partition="1-1")
        late_xids = late.prepare()
        with cluster.client(Admin) as admin:
            wait_until(lambda: not admin.prepared_transactions(1), timeout=15, what="timed-out prepared")
        decision, _ = txn_decisions.read(zk, late_path)
        assert decision.outcome == "abort" and decision.aborted == ["r2"]
        with pytest.raises(txn_decisions.TransactionsAbortedError, match="rolled back run r2"):
            txn_decisions.decide_commit(zk, late_path, "r2", late_xids)
        # A replay of the batch by a new run may still commit its own transactions.
        assert txn_decisions.decide_commit(zk, late_path, "r3", [[1, "other"]]).run == "r3"
        assert visible(cluster, "t", "1-1") == []


def test_open_transactions_time_out(cluster):
    start(cluster, timeout_ms=500)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        txn = p.transaction("slow")
        txn.send_batch("t", [b"x"], partition="1-0")
        time.sleep(3)  # 0.5 s timeout, checked every second
        with pytest.raises(RemoteTransactionError, match="rolled back"):
            txn.prepare()
    assert visible(cluster, "t", "1-0") == []


def test_the_resolver_forgets_outcomes_only_once_their_decision_record_is_gone(tmp_path, zk, zk_root):
    """Outcomes kept for a decision record are dropped by the resolver's sweep after the record is deleted
    (a replay can no longer ask), not before."""
    from metaq_broker.store import MessageStore, TopicConfig
    from metaq_broker.store.transactions import TransactionManager
    from metaq_broker.server.txn_resolver import TransactionResolver
    store = MessageStore(tmp_path / "data", {"t": TopicConfig(num_partitions=1)}, background_interval=None)
    tx = TransactionManager(store, tmp_path / "data" / "transactions")
    kept, gone = f"{zk_root}/sinks/s/batches/1", f"{zk_root}/sinks/s/batches/2"
    for xid, path in (("a", kept), ("b", gone)):
        zk.create(path, b"{}", makepath=True)
        tx.begin(xid, coordinator=json.dumps({"path": path, "run": "r"}))
        tx.prepare(xid)
        tx.commit(xid)
    zk.delete(gone)
    assert TransactionResolver(tx, 1, lambda: zk).forget_gone_records(zk) == 1
    assert tx.state("a") == "committed" and tx.state("b") is None
    tx.close()
    store.close()


WRITER_DIES = """
import os, signal, sys
from metaq_broker.client import Producer
p = Producer(zk_connect=sys.argv[1], zk_root=sys.argv[2])
t = p.transaction("dies")
t.send_batch("t", [b"never"], partition="1-0")
os.kill(os.getpid(), signal.SIGKILL)  # before prepare
"""


def test_a_writer_killed_before_prepare_holds_readers_only_until_the_transaction_timeout(cluster):
    import signal
    import subprocess
    import sys
    start(cluster, timeout_ms=3000)
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        p.send_batch("t", [b"before"], partition="1-0")
        child = subprocess.run([sys.executable, "-c", WRITER_DIES, cluster.zk_connect, cluster.zk_root],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr
        p.send_batch("t", [b"after"], partition="1-0")
        assert visible(cluster, "t", "1-0") == [b"before"]  # held back at the open transaction's batch
        wait_until(lambda: visible(cluster, "t", "1-0") == [b"before", b"after"], timeout=15,
                   what="the open transaction rolled back after transactionTimeout")


def test_an_open_transaction_left_out_of_its_decision_is_rolled_back_at_once(cluster, zk):
    """A task attempt that died before its prepare leaves an open transaction; once the batch's decision
    (written by the retry) leaves it out, the broker rolls it back well before transactionTimeout."""
    start(cluster, timeout_ms=600_000)
    path = f"{cluster.zk_root}/sinks/s2/batches/3"
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
        dead = p.transaction("s2/3/r1/0-1", coordinator=json.dumps({"path": path, "run": "r1"}))
        dead.send_batch("t", [b"dead attempt"], partition="1-0")
        retry = p.transaction("s2/3/r1/0-2", coordinator=json.dumps({"path": path, "run": "r1"}))
        retry.send_batch("t", [b"retry"], partition="1-0")
        xids = retry.prepare()
        time.sleep(2)  # a few resolver rounds: no decision yet, so the open one stays
        assert visible(cluster, "t", "1-0") == []
        txn_decisions.decide_commit(zk, path, "r1", xids)
        retry.commit()
        wait_until(lambda: visible(cluster, "t", "1-0") == [b"retry"], timeout=10, what="the dead attempt rolled back")
        with pytest.raises(RemoteTransactionError, match="rolled back"):
            dead.prepare()
