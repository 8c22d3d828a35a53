"""Null values (Kafka tombstones) and create times (Kafka's CreateTime) through every part that touches
them: the store (appends, a reopen's recovery, the index's byte counts), a real broker with metaq's Producer
and Consumer, ``metaq consume``, and Spark's source and sink."""
import datetime
import json

import pyarrow as pa
import pytest
from conftest import wait_until
import cli
from spark_helpers import reader

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.errors import InvalidMessageError
from metaq_broker.protocol import records
from metaq_broker.store import PartitionLog, TopicConfig

pytestmark = pytest.mark.unit

CREATED = 1_600_000_000_000  # long before any store time of this run


def test_the_store_keeps_null_values_and_create_times_across_a_reopen(tmp_path):
    config = TopicConfig(max_segment_size=4096, index_interval_bytes=256)
    log = PartitionLog.open(tmp_path, "t", 0, config)
    want = []
    for i in range(200):  # several segments, their indexes sealed, and an active one recovered by a scan
        values = [None if j % 3 == 0 else b"v%d" % j * (i % 7) for j in range(i % 5 + 1)]
        times = [CREATED + 1000 * i + j for j in range(len(values))] if i % 2 else None
        log.append(values, keys=[b"k%d" % i] * len(values), timestamps=times)
        want += [(v, t) for v, t in zip(values, times or [None] * len(values))]
    log.close()
    log = PartitionLog.open(tmp_path, "t", 0, config)
    assert len(log.segments()) > 3 and log.verify() == []
    got = []
    offset = 0
    while offset < log.last_stable_offset:
        r = log.read(offset, 1 << 20)
        d = records.decode(r.data, r.start_offset, r.end_offset, timestamp_type=True)
        got += zip(d.column("value").to_pylist(), d.column("timestamp").cast(pa.int64()).to_pylist(),
                   d.column("timestampType").to_pylist())
        offset = r.end_offset
    assert [v for v, _, _ in got] == [v for v, _ in want]
    for (_, ts, kind), (_, created) in zip(got, want):
        if created is None:
            assert kind == records.LOG_APPEND_TIME and ts > CREATED + 10 ** 8  # the store time
        else:
            assert (ts, kind) == (created, records.CREATE_TIME)
    # byte budgets count a null value as no bytes, and narrow columns as their widths (the index's sizes)
    sizes = records.index_columns(log.read(0, 1 << 30).data, log.read(0, 1 << 30).batch_positions)[0]
    assert log.range_bytes(0, len(sizes)) == int(sizes.sum())
    log.close()


@pytest.fixture
def broker(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    with cluster.client(Producer) as p:
        wait_until(lambda: p.cluster.topic_partitions("t"), what="topic t")
    return cluster


def consume_cli(cluster, *args):
    r = cli.metaq_on(cluster, "consume", "t", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_producer_consumer_and_cli_carry_tombstones_and_create_times(broker):
    when = datetime.datetime(2021, 5, 6, 7, 8, 9, 123000, tzinfo=datetime.timezone.utc)
    with broker.client(Producer, linger_ms=5000) as p:  # the two send() calls go in one batch (flush)
        p.send_batch("t", [b"a", None, b""], keys=[b"k", b"k", None], partition="1-0")  # store times
        p.send_batch("t", pa.array([None, b"b"]), partition="1-0", timestamps=[CREATED, when])
        before = records.now_ms()
        futures = [p.send("t", None, key=b"gone", partition="1-0", timestamp=CREATED + 5),
                   p.send("t", b"c", partition="1-0")]
        p.flush()
        after = records.now_ms()
        assert [f.result().offset for f in futures] == [5, 6]
        with pytest.raises(InvalidMessageError, match="value column is missing"):
            p.send_batch("t", None, partition="1-0")
        with pytest.raises(InvalidMessageError, match="timestamp of message 0 is -5"):
            p.send_batch("t", [b"x"], partition="1-0", timestamps=[-5])
    with broker.client(Consumer) as c:
        messages = c.fetch("t", "1-0", 0).messages()
        table = c.read_range("t", "1-0", 0, 7)
    assert [m.value for m in messages] == [b"a", None, b"", None, b"b", None, b"c"]
    assert table.column("value").to_pylist() == [m.value for m in messages]
    assert [m.timestamp_type for m in messages] == [1, 1, 1, 0, 0, 0, 0]  # a batch with a create time stamps all
    created = [int(m.timestamp.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000) for m in messages[3:6]]
    assert created == [CREATED, int(when.timestamp() * 1000), CREATED + 5]
    stamped = int(messages[6].timestamp.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)
    assert before <= stamped <= after  # sent without one beside one that has one: stamped when encoded
    assert consume_cli(broker, "--max", "7").splitlines() == [b"a", b"null", b"", b"null", b"b", b"null", b"c"]
    rows = [json.loads(line) for line in consume_cli(broker, "--max", "7", "--format", "json").splitlines()]
    assert [r["value"] for r in rows] == ["a", None, "", None, "b", None, "c"]
    assert [r["timestampType"] for r in rows] == ["LogAppendTime"] * 3 + ["CreateTime"] * 4
    assert rows[4]["timestamp"].startswith("2021-05-06T07:08:09.123")


def test_spark_reads_and_writes_tombstones_and_says_the_timestamp_type(spark, broker):
    with broker.client(Producer) as p:
        p.send_batch("t", [b"x", None], partition="1-0", timestamps=[CREATED, CREATED + 1])
        p.send_batch("t", [None, b"y"], partition="1-0")
    df = reader(spark, broker, subscribe="t")
    assert df.schema["value"].nullable and df.schema["timestampType"].dataType.simpleString() == "int"
    got = df.selectExpr("value", "timestampType", "unix_millis(timestamp) AS ms").orderBy("offset").collect()
    assert [(r.value, r.timestampType) for r in got] == [(b"x", 0), (None, 0), (None, 1), (b"y", 1)]
    assert [r.ms for r in got[:2]] == [CREATED, CREATED + 1] and got[2].ms > CREATED + 10 ** 8

    def given_schema(schema):
        return spark.read.format("metaq").schema(schema).option("metaq.zk.connect", broker.zk_connect) \
            .option("metaq.zk.root", broker.zk_root).option("subscribe", "t").load().orderBy("offset").collect()
    assert [r.timestampType for r in given_schema("offset long, timestampType int")] == [0, 0, 1, 1]
    assert [r.value for r in given_schema("value binary, offset long")] == [b"x", None, None, b"y"]
    # the sink writes a null value as a tombstone, as Kafka's sink does
    rows = spark.createDataFrame([("k1", None), ("k2", "v")], "key string, value string")
    (rows.write.format("metaq").option("metaq.zk.connect", broker.zk_connect).option("metaq.zk.root", broker.zk_root)
     .option("topic", "t").mode("append").save())
    tail = reader(spark, broker, subscribe="t").where("offset >= 4").select("key", "value").collect()
    assert sorted((r.key, r.value) for r in tail) == [(b"k1", None), (b"k2", b"v")]


def test_the_metaq_stream_goes_on_past_a_reset_after_null_values(tmp_path):
    """docs/storage-format.md 3.5: where the stream continues from a segment's start (a replica's reset), it
    starts past every position before it, also after messages whose MetaQ size is many times their log size
    (a null value: a 20-byte head in MetaQ's layout, a 1-byte length in the log)."""
    log = PartitionLog.open(tmp_path, "t", 0, TopicConfig())
    for _ in range(20):
        log.append([None] * 1000)
    before = log.metaq_end
    assert before == 20 * 1000 * records.METAQ_MESSAGE_HEAD
    log.reset_to(log.log_end_offset)
    assert log.metaq_end > before
    log.append([b"x"])
    after = log.metaq_end
    log.close()
    log = PartitionLog.open(tmp_path, "t", 0, TopicConfig())
    assert log.metaq_end == after
    log.close()
