"""One wait on several partitions (a Kafka Fetch's long poll): a log sets every event watching it when its
readable end moves, ``RequestHandler.wait_for_any`` wakes on data in any partition it watches, and a Kafka
consumer assigned two idle partitions gets what arrives on either."""
import threading

import pytest
from confluent_kafka import Consumer, TopicPartition

from metaq_broker.errors import UnknownTopicError
from metaq_broker.security.tls import ANONYMOUS
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.store import PartitionLog, TopicConfig

pytestmark = pytest.mark.process


def test_a_watch_event_is_set_by_an_append_to_any_watched_partition(tmp_path):
    logs = [PartitionLog.open(tmp_path / f"t-{p}", "t", p, TopicConfig()) for p in (0, 1)]
    try:
        event = threading.Event()
        for log in logs:
            log.watch(event)
        logs[1].append([b"x"])
        assert event.is_set()
        event.clear()
        logs[0].append([b"y"])
        assert event.is_set()
        event.clear()
        for log in logs:
            log.unwatch(event)
        logs[1].append([b"z"])
        assert not event.is_set()  # unwatched: no longer told
    finally:
        for log in logs:
            log.close()


@pytest.fixture
def broker(tmp_path):
    """An in-process broker without ZooKeeper, its Kafka listener on a free port."""
    ini = tmp_path / "broker.ini"
    ini.write_text("[system]\nnumPartitions=2\n\n[topic=t]\n")
    b = Broker(load(str(ini), {"brokerId": "1", "serverPort": "0", "zk.connect": "none", "kafkaPort": "0",
                               "dataPath": str(tmp_path / "data")})).start()
    yield b
    b.stop()


def test_wait_for_any_wakes_on_data_in_either_partition_and_times_out_without(broker):
    h = broker.handler
    assert not h.wait_for_any(ANONYMOUS, [("t", 0, 0), ("t", 1, 0)], 50, lambda: True)  # nothing: times out
    started = threading.Event()

    def put_later():
        started.wait(30)
        broker.store.partition("t", 1).append([b"late"])
    writer = threading.Thread(target=put_later)
    writer.start()
    try:
        started.set()
        assert h.wait_for_any(ANONYMOUS, [("t", 0, 0), ("t", 1, 0)], 60_000, lambda: True)
    finally:
        writer.join(30)
    assert h.wait_for_any(ANONYMOUS, [("t", 1, 0)], 0, lambda: True)  # data already there: no wait
    assert not h.wait_for_any(ANONYMOUS, [("t", 0, 0)], 60_000, lambda: False)  # the caller left: no wait
    with pytest.raises(UnknownTopicError):
        h.wait_for_any(ANONYMOUS, [("t", 0, 0), ("nope", 0, 0)], 10, lambda: True)


def test_a_kafka_consumer_on_two_idle_partitions_gets_what_arrives_on_either(broker):
    c = Consumer({"bootstrap.servers": f"127.0.0.1:{broker.kafka_port}", "group.id": "g", "log_level": 3,
                  "enable.auto.commit": False, "fetch.wait.max.ms": 5000})
    try:
        c.assign([TopicPartition("t", p, 0) for p in (0, 1)])
        # both idle: the fetch is parked on both (errors: FindCoordinator is refused without ZooKeeper)
        assert [m for m in c.consume(1, 1.0) if m.error() is None] == []
        got = []
        for p, value in ((1, b"one"), (0, b"zero"), (1, b"two")):
            broker.store.partition("t", p).append([value])
            while not got or got[-1] != (p, value):
                ms = c.consume(1, 30)
                assert ms, f"nothing consumed after {value!r} was stored in partition {p}"
                got += [(m.partition(), m.value()) for m in ms if m.error() is None]
        assert got == [(1, b"one"), (0, b"zero"), (1, b"two")]
    finally:
        c.close()
