"""A replicated broker group as real processes: members copy the master's log byte for byte, the in-sync
set forms, a killed master is replaced by an in-sync member (again and again, under load), acknowledged
messages survive, the old master rejoins as a replica with the same log, and a stopping master hands over."""
import collections
import threading
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


def in_sync_seen(producer, broker_id: int = 1) -> list:
    """The in-sync set as the group's master holds it (DescribeGroup). ZooKeeper's state holds an expansion
    a moment before the master applies it (and a shrink before it leaves the ack set), so a put that needs
    ``minInSyncReplicas`` waits for this, not for ``BrokerGroup.wait_in_sync`` alone."""
    from metaq_broker.proto import metaq_pb2 as pb
    reply = producer.connection(broker_id).call("DescribeGroup", pb.DescribeGroupRequest(), retries=3)
    return sorted(m.replica_id for m in reply.members if m.in_sync)


def log_bytes(data_path, topic="orders", partitions=2) -> list:
    """Every partition's record bytes, read from a stopped member's data directory."""
    store = MessageStore(data_path, background_interval=None)
    try:
        out = []
        for p in range(partitions):
            part = store.partition(topic, p)
            chunks, offset = [], part.earliest_offset
            while offset < part.visible_end:
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


class Load(threading.Thread):
    """A producer sending one value per ``acks=all`` put, without pause, until stopped: ``acked`` were
    acknowledged; ``failed`` were not (they may or may not be stored; the producer itself resent every
    refusal that stored nothing)."""

    def __init__(self, producer, prefix: bytes):
        super().__init__(daemon=True)
        self.producer, self.prefix = producer, prefix
        self.acked, self.failed = [], []
        self.done = threading.Event()

    def run(self):
        i = 0
        while not self.done.is_set():
            v = b"%s-%d" % (self.prefix, i)
            i += 1
            try:
                self.producer.send_batch("orders", [v])
                self.acked.append(v)
            except Exception as e:  # noqa: BLE001 - counted; the test says whether that is acceptable
                self.failed.append((v, repr(e)))
                time.sleep(0.05)

    def progress(self, more: int = 20) -> None:
        """Wait until ``more`` further puts were acknowledged (the producer carries on)."""
        n = len(self.acked)
        wait_until(lambda: len(self.acked) >= n + more, timeout=30,
                   what=f"{more} more acknowledged puts (failed so far: {self.failed[-3:]})")

    def finish(self) -> None:
        self.done.set()
        self.join(timeout=60)
        assert not self.is_alive()


def test_group_replicates_and_fails_over(tmp_path, zookeeper, zk_root):
    """One group for the whole story: replication, the master killed (``kill -9``) three times in a row under
    ``acks=all`` load, each time rejoining, then a graceful stop (SIGTERM) of the master under load: an
    in-sync member takes over, nothing acknowledged is lost or duplicated, every log ends identical."""
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

            load = Load(producer, b"k")
            load.start()
            try:
                load.progress()
                master, epoch = first, state["epoch"]
                for _ in range(3):  # a crash of the master: an in-sync member takes over, the old one rejoins
                    isr = {r for r, _ in group.state()["isr"]}
                    group.members[master].kill()
                    new = group.wait_master(timeout=30, other_than=master)
                    assert new in isr
                    assert group.state()["epoch"] > epoch
                    epoch = group.state()["epoch"]
                    load.progress()
                    group.members[master].start()
                    group.wait_in_sync(range(3))
                    master = new
                load.progress()
            finally:
                load.finish()
            seen = read_all(consumer)
            assert len(seen) == len(set(seen)), "a message was stored twice"
            lost = set(acked + load.acked) - set(seen)
            assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"

            # a graceful stop of the master under load: it hands over to an in-sync member at once
            load = Load(producer, b"t")
            load.start()
            try:
                load.progress()
                isr = {r for r, _ in group.state()["isr"]}
                assert group.members[master].stop() == 0
                assert "resigning so one of them is elected at once" in group.members[master].log_path.read_text()
                new = group.wait_master(timeout=30, other_than=master)
                assert new in isr and group.state()["epoch"] > epoch
                load.progress()
                group.members[master].start()
                group.wait_in_sync(range(3))
                load.progress()
            finally:
                load.finish()
            final = read_all(consumer)
            assert group.master_id() == new
    finally:
        group.stop()
    logs = [log_bytes(m.workdir / "data") for m in group.members]
    assert logs[0] == logs[1] == logs[2], "members' logs differ"
    twice = [v for v, n in collections.Counter(final).items() if n > 1]
    assert not twice, f"stored twice: {twice[:5]}"
    lost = set(load.acked) - set(final)
    assert not lost, f"{len(lost)} acknowledged messages lost in the graceful stop, e.g. {sorted(lost)[:5]}"
    assert set(seen) <= set(final)
    assert np.sum([len(x) for x in logs[0]]) > 0
