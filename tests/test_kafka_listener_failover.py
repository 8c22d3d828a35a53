"""A replicated group's master killed (SIGKILL) under a confluent-kafka idempotent producer with acks=all:
the client follows the new master's Kafka address (Metadata names node <brokerId> at the master's
listener), and every message it was told is stored is there afterwards, once. Real processes: three
``metaq-broker`` members, ZooKeeper, librdkafka."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from conftest import wait_until

from metaq_broker.devtools.group import BrokerGroup

pytestmark = pytest.mark.process

QUIET = {"log_level": 0}  # the killed member's connection errors are expected


def test_a_master_killed_under_a_kafka_producer_loses_and_doubles_nothing(tmp_path, zookeeper, zk_root):
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                        topics={"t": {"numPartitions": 2}}).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(3))
        bootstrap = ",".join(m.bootstrap for m in group.members)
        acked, failed, stop = [], [], threading.Event()

        def delivered(err, msg):
            (failed if err else acked).append(err if err else msg.value())

        def produce():
            p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                          "linger.ms": 5, "message.timeout.ms": 60000, **QUIET})
            i = 0
            while not stop.is_set() and i < 20000:
                p.produce("t", b"m-%06d" % i, key=b"k%d" % (i % 17), on_delivery=delivered)
                p.poll(0)
                i += 1
                if i % 100 == 0:
                    time.sleep(0.01)
            assert p.flush(90) == 0

        thread = threading.Thread(target=produce)
        thread.start()
        wait_until(lambda: len(acked) >= 1000, timeout=60, what="acknowledged messages before the kill")
        os.kill(group.members[first].proc.pid, signal.SIGKILL)
        group.wait_master(timeout=30, other_than=first)
        before = len(acked)
        wait_until(lambda: len(acked) >= before + 1000, timeout=90, what="acknowledged messages after the failover")
        stop.set()
        thread.join(120)
        assert not thread.is_alive()
        assert not failed, failed[:3]
        master = group.members[group.wait_master()]
        c = Consumer({"bootstrap.servers": master.bootstrap, "group.id": "check", "enable.auto.commit": False,
                      **QUIET})
        ends = [c.get_watermark_offsets(TopicPartition("t", p), timeout=15)[1] for p in (0, 1)]
        c.assign([TopicPartition("t", p, 0) for p in (0, 1)])
        seen, deadline = [], time.monotonic() + 60
        while len(seen) < sum(ends) and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and m.error() is None:
                seen.append(m.value())
        c.close()
        assert len(seen) == len(set(seen)), "duplicates"
        assert set(acked) <= set(seen), f"{len(set(acked) - set(seen))} acknowledged messages lost"
    finally:
        group.stop()
