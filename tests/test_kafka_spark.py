"""Messages written by Kafka clients through the Kafka listener, read by metaq's Spark source: each once,
with their keys, values, create times and (``includeHeaders``) headers, as Kafka's own Spark source gives
them. Real Spark, a real broker process and ZooKeeper, confluent-kafka."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from conftest import wait_until

pytestmark = pytest.mark.process

N = 300


def _reader(spark, cluster, **options):
    r = spark.read.format("metaq").option("metaq.zk.connect", cluster.zk_connect) \
        .option("metaq.zk.root", cluster.zk_root).option("subscribe", "t")
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def test_kafka_written_messages_read_by_the_spark_source_once_with_headers(cluster, spark):
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    wait_until(lambda: len(AdminClient({"bootstrap.servers": b.bootstrap}).list_topics("t", timeout=5)
                           .topics["t"].partitions) == 2, what="t in Kafka metadata")
    base = int(time.time() * 1000) - 10_000
    p = Producer({"bootstrap.servers": b.bootstrap, "enable.idempotence": True, "compression.codec": "snappy",
                  "log_level": 3})
    for i in range(N):
        p.produce("t", b"v%d" % i, key=b"k%d" % i, timestamp=base + i,
                  headers=[("i", b"%d" % i), ("n", None)] if i % 2 else None)
    assert p.flush(30) == 0

    plain = _reader(spark, cluster)
    assert "headers" not in plain.columns  # as Kafka's source: only with includeHeaders
    rows = _reader(spark, cluster, includeHeaders="true").collect()
    assert len(rows) == N and len({r.value for r in rows}) == N  # each message once
    for r in rows:
        i = int(r.value[1:])
        assert r.key == b"k%d" % i and r.timestampType == 0
        assert int(r.timestamp.timestamp() * 1000) == base + i
        expected = [("i", b"%d" % i), ("n", None)] if i % 2 else None
        assert (None if r.headers is None else [(h.key, h.value) for h in r.headers]) == expected
    picked = _reader(spark, cluster, includeHeaders="true").select("value", "headers").where("value = 'v1'").collect()
    assert [(h.key, h.value) for h in picked[0].headers] == [("i", b"1"), ("n", None)]
