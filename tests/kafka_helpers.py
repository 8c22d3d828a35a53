"""Helpers shared by the tests that check with confluent-kafka what a topic holds."""
import time

from confluent_kafka import Consumer, KafkaError, TopicPartition


def read_to_end(bootstrap: str, topic: str, partitions: int = 1, timeout: float = 60, **conf) -> list:
    """(partition, offset, key, value) of every message a consumer reading from offset 0 gets, until each
    partition says it is at its end. The end is told by the client's end-of-partition event, not by counting
    up to the end offset: offsets that hold control records (transaction markers, a replicated group's epoch
    markers) are never delivered, so a count stops short and waits out its deadline."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "check", "enable.auto.commit": False,
                  "enable.partition.eof": True, **conf})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        seen, at_end, last_error = [], set(), None
        deadline = time.monotonic() + timeout
        while len(at_end) < partitions:
            assert time.monotonic() < deadline, (f"{topic}: partitions {sorted(set(range(partitions)) - at_end)} "
                                                 f"not read to their end in {timeout}s (last error: {last_error})")
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is None:
                seen.append((m.partition(), m.offset(), m.key(), m.value()))
            elif m.error().code() == KafkaError._PARTITION_EOF:
                at_end.add(m.partition())
            else:
                last_error = m.error()
        return seen
    finally:
        c.close()
