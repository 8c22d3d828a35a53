"""The Spark sink's ``headers`` column (Kafka's sink type ``array<struct<key: string, value: binary>>``),
written as Kafka record headers: read back by metaq's Spark source (``includeHeaders``) and by a Kafka
client (confluent-kafka) as written, batch and streaming, both delivery guarantees; a wrong type refused
before any task runs; a null header key failing the write naming its row; a task retried under
exactly-once writing each row's headers once. Real Spark, broker processes and ZooKeeper."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition
from conftest import wait_until
from pyspark import TaskContext
from pyspark.sql import functions as F
from spark_helpers import reader
from test_spark_sink import prepared, settled, writer

from metaq_broker.client.consumer import Consumer as MetaqConsumer
from metaq_spark.options import parse_sink
from metaq_spark.sink import SinkSchemaError, check_schema

SCHEMA = "value string, headers array<struct<key:string,value:binary>>"
BIG = 256 << 10  # a header value of 256 KiB on some rows


SPARK_MASTER = "local[2,4]"  # two task threads, and a failed task is tried up to 4 times (as on a cluster)


def header_rows(n: int, tag: str) -> list:
    """(value, headers): no headers (null and empty), several, repeated keys with a null value, non-ASCII
    and empty keys, large values."""
    rows = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            h = None
        elif kind == 1:
            h = []
        elif kind == 2:
            h = [("trace", b"t%d" % i), ("span", b"s%d" % i)]
        elif kind == 3:
            h = [("dup", b"1"), ("dup", b"2"), ("dup", None)]
        elif kind == 4:
            h = [("clé-ключ-鍵", f"värde {i}".encode()), ("", b"")]
        else:
            h = [("big", bytes([i % 251]) * (BIG if i % 60 == 5 else 100))]
        rows.append((f"{tag}{i}", h))
    return rows


def expected(rows) -> dict:
    """value -> headers as a reader sees them: a message without headers (null or empty) has null."""
    return {v: [tuple(x) for x in h] if h else None for v, h in rows}


def written(spark, cluster, topic: str) -> dict:
    got = reader(spark, cluster, subscribe=topic, includeHeaders="true").select("value", "headers").collect()
    out = {}
    for r in got:
        assert r.value.decode() not in out, f"{r.value!r} written twice"
        out[r.value.decode()] = None if r.headers is None else [(h.key, h.value) for h in r.headers]
    return out


def stream(df, cluster, checkpoint, **options):
    """``df`` (a streaming frame) into the metaq sink until it has written what is there now."""
    w = df.writeStream.format("metaq").option("metaq.zk.connect", cluster.zk_connect) \
        .option("metaq.zk.root", cluster.zk_root).option("checkpointLocation", str(checkpoint))
    for k, v in options.items():
        w = w.option(k, v)
    q = w.trigger(availableNow=True).start()
    assert q.awaitTermination(180), "the streaming write did not finish"
    assert q.exception() is None, q.exception()


def test_a_wrong_headers_type_is_refused_before_any_task(spark, cluster, tmp_path):
    zk = {"metaq.zk.connect": cluster.zk_connect, "topic": "t"}
    for ddl, found in [
        ("value string, headers string", "string"),
        ("value string, headers array<struct<key:string,value:string>>", "array<struct<key:string,value:string>>"),
        ("value string, headers array<struct<k:string,v:binary>>", "array<struct<k:string,v:binary>>"),
        ("value string, headers array<struct<value:binary,key:string>>", "array<struct<value:binary,key:string>>"),
        ("value string, headers map<string,binary>", "map<string,binary>"),
        ("value string, headers array<binary>", "array<binary>"),
    ]:
        with pytest.raises(SinkSchemaError, match=rf"column 'headers' has type {found}; the metaq sink needs "
                                                  rf"array<struct<key: string, value: binary>>"):
            check_schema(spark.createDataFrame([], ddl).schema, parse_sink(zk))
    # Kafka's type, whatever Spark says about its nulls, is taken
    assert check_schema(spark.createDataFrame([], SCHEMA).schema, parse_sink(zk)) == {"value": 0, "headers": 1}
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    bad = spark.createDataFrame([("a", [("k", "v")])], "value string, headers array<struct<key:string,value:string>>")
    with pytest.raises(Exception, match=r"column 'headers' has type array<struct<key:string,value:string>>; "
                                        r"the metaq sink needs array<struct<key: string, value: binary>>"):
        writer(bad, cluster, topic="t").save()
    with pytest.raises(Exception, match=r"column 'headers' has type map<string,binary>"):
        (spark.readStream.format("rate").load()
         .select(F.col("value").cast("string").alias("value"),
                 F.create_map(F.lit("k"), F.lit(b"v")).alias("headers"))
         .writeStream.format("metaq").option("metaq.zk.connect", cluster.zk_connect)
         .option("metaq.zk.root", cluster.zk_root).option("topic", "t")
         .option("checkpointLocation", str(tmp_path / "ck")).start().awaitTermination(60))
    assert written(spark, cluster, "t") == {}


def test_headers_round_trip_batch_and_streaming_both_guarantees(spark, cluster, tmp_path):
    """Spark sink -> metaq's source with includeHeaders, and -> a Kafka client, the same headers; the
    source's headers column written back by the sink as it is (metaq -> metaq, as Kafka -> Kafka)."""
    topics = ("be", "ba", "se", "sa")
    b = cluster.start_broker(1, topics={t: {"numPartitions": 2} for t in topics + ("copy",)})
    all_rows = {}
    for topic in topics:
        guarantee = "exactly-once" if topic[1] == "e" else "at-least-once"
        rows = all_rows[topic] = header_rows(240, topic)
        df = spark.createDataFrame(rows, SCHEMA).repartition(3)
        if topic[0] == "b":
            writer(df, cluster, topic=topic, deliveryGuarantee=guarantee).save()
        else:  # a file stream of the same rows
            df.write.parquet(str(tmp_path / topic))
            stream(spark.readStream.schema(SCHEMA).parquet(str(tmp_path / topic)), cluster, tmp_path / f"ck-{topic}",
                   topic=topic, deliveryGuarantee=guarantee)
        assert written(spark, cluster, topic) == expected(rows), topic
    # metaq -> metaq, as Kafka -> Kafka: the source's headers column is the sink's
    copied = reader(spark, cluster, subscribe="be", includeHeaders="true").select("value", "key", "headers")
    writer(copied, cluster, topic="copy").save()
    assert written(spark, cluster, "copy") == expected(all_rows["be"])
    # A Kafka client reads the headers the sink wrote (None: a record without headers)
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "unused", "enable.auto.commit": False,
                  "log_level": 3, "fetch.message.max.bytes": 4 << 20})
    try:
        for topic in ("be", "sa"):
            c.assign([TopicPartition(topic, p, 0) for p in range(2)])
            got, deadline = {}, time.monotonic() + 60
            while len(got) < 240 and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is None:
                    continue
                assert m.error() is None, m.error()
                assert m.value().decode() not in got
                got[m.value().decode()] = m.headers()
            assert got == expected(all_rows[topic]), topic
    finally:
        c.close()


def test_a_null_header_key_fails_the_write_naming_its_row(spark, cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    rows = [(f"v{i}", [("k", b"x")]) for i in range(10)] + [("bad", [("ok", b"1"), (None, b"2")])]
    for guarantee in ("exactly-once", "at-least-once"):
        with pytest.raises(Exception, match=r"the headers column: row 10 of this task has a header that has a null "
                                            r"key \(its header 1\); Kafka header keys are strings, never null"):
            writer(spark.createDataFrame(rows, SCHEMA).coalesce(1), cluster, topic="t",
                   deliveryGuarantee=guarantee).save()
    nulls = [("v", [("k", b"x"), None])]
    with pytest.raises(Exception, match=r"row 0 of this task has a header that is null \(its header 1\)"):
        writer(spark.createDataFrame(nulls, SCHEMA), cluster, topic="t").save()
    # the rows were checked before their batch was sent: nothing at all was written
    assert written(spark, cluster, "t") == {}


def test_exactly_once_across_a_task_retry_writes_each_rows_headers_once(spark, cluster, tmp_path):
    """A task fails on its first attempt after some Arrow batches (and their headers) are in the broker's log
    in its open transaction; the retry writes every row once, with its headers once, the first attempt's
    rolled back."""
    cluster.start_broker(1, topics={"r": {"numPartitions": 2}})
    zk_connect, zk_root, seen = cluster.zk_connect, cluster.zk_root, str(tmp_path / "seen")

    @F.udf("string")
    def value(i):
        if i == 300 and TaskContext.get().attemptNumber() == 0:
            deadline = time.monotonic() + 60  # until the attempt's puts are in the log, in its open transaction
            with MetaqConsumer(zk_connect=zk_connect, zk_root=zk_root) as c:
                while not any(stable < end for _, stable, end in c.offset_bounds("r").values()):
                    assert time.monotonic() < deadline, "the first attempt's messages never reached the log"
                    time.sleep(0.05)
            open(seen, "w").close()
            raise RuntimeError("injected failure on the first attempt")
        return f"r{i}"

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "20")
    try:
        df = spark.range(0, 400, numPartitions=2).select(
            value("id").alias("value"),
            F.array(F.struct(F.lit("n").alias("key"), F.col("id").cast("string").cast("binary").alias("value")),
                    F.struct(F.lit("n").alias("key"), F.lit(None).cast("binary").alias("value"))).alias("headers"))
        writer(df, cluster, topic="r").save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert (tmp_path / "seen").exists(), "the first attempt failed before any of its messages reached the log"
    wait_until(lambda: settled(cluster, "r"), timeout=20, what="every transaction on r settled")
    assert written(spark, cluster, "r") == {f"r{i}": [("n", str(i).encode()), ("n", None)] for i in range(400)}
    assert not prepared(cluster, 1)
