"""What a put's acknowledgement says under each flush policy (docs/replication.md, "What an acknowledgement
means", sentences 6 and 7), with real processes: group commit (fsynced), ``unflushThreshold`` > 0 (written
on the master, held by every in-sync replica when answered, so it survives the master's kill -9), and a
group of one."""
import grpc

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from conftest import wait_until

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
            assert values(consumer, "written") == [b"w"] and values(consumer, "synced") == [b"s"]
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
