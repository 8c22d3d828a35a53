"""A replicated broker group as real processes: members copy the master's log byte for byte, the in-sync
set forms, a killed master is replaced by an in-sync member, acknowledged messages survive, and the old
master rejoins as a replica with the same log."""
import time

import numpy as np

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.store import MessageStore
from conftest import wait_until

TOPICS = {"orders": {"numPartitions": 2}}


def read_all(consumer, topic="orders") -> list:
    out = []
    for name, (start, end) in consumer.offsets(topic).items():
        out += consumer.read_range(topic, name, start, end).column("value").to_pylist()
    return out


def log_bytes(data_path, topic="orders", partitions=2) -> list:
    """Every partition's record bytes, read from a stopped member's data directory."""
    store = MessageStore(data_path, background_interval=None)
    try:
        out = []
        for p in range(partitions):
            part = store.partition(topic, p)
            chunks, offset = [], part.earliest_offset
            while offset < part.log_end_offset:
                r = part.read(offset, 8 << 20)
                chunks.append(r.data.tobytes())
                offset = r.end_offset
            out.append(b"".join(chunks))
        return out
    finally:
        store.close()


def send_acked(producer, values) -> list:
    """Send each value on its own; return those acknowledged (never resent: an unacknowledged one may or
    may not be stored)."""
    acked = []
    for v in values:
        try:
            producer.send_batch("orders", [v])
            acked.append(v)
        except Exception:  # noqa: BLE001 - a failover in progress
            time.sleep(0.05)
    return acked


def test_group_replicates_and_fails_over(tmp_path, zookeeper, zk_root):
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3, topics=TOPICS).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(3))
        state = group.state()
        assert state["master"] == first and state["epoch"] >= 1
        with Producer(zk_connect=zookeeper.connect_string, zk_root=zk_root, timeout=20.0) as producer, \
                Consumer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
            acked = send_acked(producer, [b"a-%d" % i for i in range(200)])
            assert len(acked) == 200
            assert sorted(read_all(consumer)) == sorted(acked)

            # a crash of the master: an in-sync member takes over, nothing acknowledged is lost
            group.members[first].kill()
            second = group.wait_master(timeout=20, other_than=first)
            wait_until(lambda: producer.cluster.brokers().get(1) == group.members[second].address,
                       what="the producer sees the new master")
            assert group.state()["epoch"] > state["epoch"]
            more = send_acked(producer, [b"b-%d" % i for i in range(100)])
            assert more, "no put succeeded after the failover"
            seen = read_all(consumer)
            assert len(seen) == len(set(seen))
            assert set(acked + more) <= set(seen)

            # the old master comes back as a replica and catches up
            group.members[first].start()
            group.wait_in_sync(range(3))
            acked_late = send_acked(producer, [b"c-%d" % i for i in range(50)])
            assert len(acked_late) == 50
            final = read_all(consumer)
            assert group.master_id() == second
    finally:
        group.stop()
    logs = [log_bytes(m.workdir / "data") for m in group.members]
    assert logs[0] == logs[1] == logs[2], "members' logs differ"
    assert set(acked + more + acked_late) <= set(final) and len(final) == len(set(final))
    assert np.sum([len(x) for x in logs[0]]) > 0
