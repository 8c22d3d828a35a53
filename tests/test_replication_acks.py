"""What a put's acknowledgement says under each flush policy (docs/replication.md, "What an acknowledgement
means", sentences 6 and 7), with real processes: group commit (fsynced), ``unflushThreshold`` > 0 (written
on the master, held by every in-sync replica when answered, so it survives the master's kill -9), and a
group of one. And what a transaction's acknowledgements say (sentence 5)."""
import os
import signal
import threading

import grpc
import pytest

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools import process
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol.status import RemoteNotEnoughReplicasError
from conftest import process_states, wait_until
from test_replication_basic import in_sync_seen

TOPICS = {"synced": {"numPartitions": 1},
          "written": {"numPartitions": 1, "unflushThreshold": 1_000_000, "unflushInterval": 3_600_000}}


def log_end(member, topic: str) -> int:
    """The member's own log end of the topic (DescribeTopic: a replica answers it for its copy)."""
    with grpc.insecure_channel(member.address) as channel:
        reply = pb_grpc.BrokerStub(channel).DescribeTopic(pb.TopicRequest(topic=topic), timeout=10)
    return reply.partitions[0].latest


def values(consumer, topic: str) -> list:
    start, end = consumer.offsets(topic)["1-0"]
    return consumer.read_range(topic, "1-0", start, end).column("value").to_pylist() if end > start else []


def test_what_a_put_acknowledgement_says_under_each_flush_policy(tmp_path, zookeeper, zk_root):
    g = BrokerGroup(tmp_path / "three", 1, zookeeper.connect_string, zk_root, members=3, topics=TOPICS).start()
    try:
        master = g.wait_master()
        g.wait_in_sync(range(3))
        z = dict(zk_connect=g.zk_connect, zk_root=g.paths.root)
        with Producer(timeout=30.0, **z) as producer, Consumer(**z) as consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("written")) == 1, what="topics routed")
            synced = producer.send_batch("synced", [b"s"])[0]
            assert synced.fsynced  # group commit: an fsync covered it
            written = producer.send_batch("written", [b"w"])[0]
            assert not written.fsynced  # unflushThreshold > 0: written, fsynced later
            end = written.base_offset + written.count
            for r in range(3):  # every in-sync replica holds it when the put is answered
                if r != master:
                    assert log_end(g.members[r], "written") >= end
            g.members[master].kill()
            second = g.wait_master(timeout=30, other_than=master)
            wait_until(lambda: producer.cluster.brokers().get(1) == g.members[second].address, what="new master")
            # Visible once the new master's high watermark passes it: when the other in-sync replica has
            # fetched from it (docs/replication.md, "Readers"), a moment after the election
            wait_until(lambda: values(consumer, "written") == [b"w"] and values(consumer, "synced") == [b"s"],
                       what="both puts read back from the new master")
    finally:
        g.stop()

    one = BrokerGroup(tmp_path / "one", 2, zookeeper.connect_string, zk_root, members=1, topics=TOPICS).start()
    try:
        one.wait_master()
        with Producer(brokers={2: one.members[0].address}, timeout=30.0) as producer, \
                Consumer(brokers={2: one.members[0].address}) as consumer:
            assert producer.send_batch("synced", [b"alone"], partition="2-0")[0].fsynced
            assert not producer.send_batch("written", [b"alone"], partition="2-0")[0].fsynced
            assert consumer.fetch("synced", "2-0", 0).batch.column("value").to_pylist() == [b"alone"]
    finally:
        one.stop()


def test_what_a_transaction_acknowledgement_means(tmp_path, zookeeper, zk_root):
    """docs/replication.md, sentence 5, clause by clause, with real processes (three members,
    minInSyncReplicas=2, replicaLagMaxMs 3 s). (a) A transaction's put is answered while both replicas are
    frozen: it does not wait for them. (b) Its prepare is not answered while they are frozen and still in
    the in-sync set; one thawed, it is answered once that one has the PREPARE (and the frozen one left
    the set), and kill -9 of the master right after the answer leaves it prepared on the new master. (c)
    A commit answered, then kill -9 of the master: committed on the next. (d) A rollback answered, then
    kill -9: rolled back on the next. (e) With the in-sync set below minInSyncReplicas a transaction's put
    is refused before it is appended (the master's log end stays) and a prepare before its record is
    written (thawed, the group does not list it as prepared)."""
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                    topics={"t": {"numPartitions": 1, "minInSyncReplicas": 2}},
                    settings={"transactionTimeout": 600_000}).start()
    z = dict(zk_connect=g.zk_connect, zk_root=g.paths.root)

    def freeze(r):
        process.freeze(g.members[r].proc.pid)

    def thaw(r):
        os.kill(g.members[r].proc.pid, signal.SIGCONT)

    def kill_master(producer) -> int:
        """kill -9 the master; restart it; return the new master once the producer routes to it."""
        first = g.master_id()
        g.members[first].kill()
        second = g.wait_master(timeout=30, other_than=first)
        wait_until(lambda: producer.cluster.brokers().get(1) == g.members[second].address, what="new master seen")
        g.members[first].start()
        return second

    def prepared(producer) -> set:
        reply = producer.connection(1).call("RecoverTransactions", pb.RecoverTransactionsRequest(), retries=3)
        return {t.xid for t in reply.transactions}

    try:
        master = g.wait_master()
        g.wait_in_sync(range(3))
        replicas = [r for r in range(3) if r != master]
        # (e)'s refusals come when a producer's timeout ends (a put and a prepare refused for want of in-sync
        # replicas are tried again until then): its transactions go through a producer with a short one
        with Producer(timeout=30.0, **z) as producer, Producer(timeout=5.0, **z) as impatient, \
                Consumer(**z) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic routed")
            a = producer.transaction("ack-a")
            for r in replicas:
                freeze(r)
            try:
                a.send_batch("t", [b"a"], partition="1-0")  # (a): answered with both replicas frozen
                done = threading.Event()
                threading.Thread(target=lambda: (a.prepare(), done.set()), daemon=True).start()
                assert not done.wait(1.0), "the prepare was answered while the in-sync replicas were frozen"
                thaw(replicas[0])
                assert done.wait(30), "the prepare was not answered once a replica was back"
                assert [r for r, _ in g.state()["isr"]] == sorted([master, replicas[0]])
            finally:
                for r in replicas:
                    thaw(r)
            kill_master(producer)  # (b): the PREPARE was on every in-sync member when answered
            assert "ack-a@1" in prepared(producer)
            g.wait_in_sync(range(3), timeout=60)

            a.commit()
            kill_master(producer)  # (c)
            assert values(consumer, "t") == [b"a"]
            g.wait_in_sync(range(3), timeout=60)

            b = producer.transaction("ack-b")
            b.send_batch("t", [b"b"], partition="1-0")
            b.prepare()
            b.rollback()
            kill_master(producer)  # (d)
            assert "ack-b@1" not in prepared(producer)
            g.wait_in_sync(range(3), timeout=60)

            master = g.master_id()
            c = impatient.transaction("ack-c")
            c.send_batch("t", [b"c"], partition="1-0")
            others = [r for r in range(3) if r != master]
            for r in others:
                freeze(r)
            try:
                # ZooKeeper has a shrink a moment before the master applies it (written, then applied): wait
                # for the master's own view too, which its refusals follow
                wait_until(lambda: [r for r, _ in g.state()["isr"]] == [master] and in_sync_seen(producer) == [master],
                           timeout=30, what="the in-sync set shrunk to the master, in ZooKeeper and on the master")
                end = consumer.offset_bounds("t")["1-0"][2]
                try:  # (e)
                    impatient.transaction("ack-d").send_batch("t", [b"d"], partition="1-0")
                    refused = None
                except RemoteNotEnoughReplicasError as e:
                    refused = e
                assert refused is not None and "nothing was written" in str(refused), (
                    f"{refused!r}; the replicas' states: {process_states(g.members[r].proc.pid for r in others)} "
                    f"(T: stopped), the in-sync set {g.state()['isr']}")
                assert consumer.offset_bounds("t")["1-0"][2] == end
                with pytest.raises(RemoteNotEnoughReplicasError, match="nothing was written"):
                    c.prepare()
            finally:
                for r in others:
                    thaw(r)
            g.wait_in_sync(range(3), timeout=60)
            assert "ack-c@1" not in prepared(producer)
            c.prepare()
            c.commit()
            assert values(consumer, "t") == [b"a", b"c"]
    finally:
        g.stop()
