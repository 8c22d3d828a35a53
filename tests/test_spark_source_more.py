"""More of the Spark source against real Spark, a real ZooKeeper and real brokers: timestamps, latest,
byte and minimum read limits, new partitions, Trigger.Once, ZooKeeper group offsets, a broker restart
between runs, and (last, with its own session) a local-cluster master."""
import datetime
import json
import re
import time

import pytest
from conftest import wait_until
from spark_helpers import fill, reader, run_available_now, spark_builder

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer


def send(cluster, topic, partition, values):
    with cluster.client(Producer) as producer:
        producer.send_batch(topic, list(values), partition=partition)








def end_offsets(q):
    """Each data batch's end offsets, in order, as {topic: {partition: offset}}."""
    out = []
    for p in q.recentProgress:
        if p["numInputRows"]:
            end = p["sources"][0]["endOffset"]
            out.append(json.loads(end) if isinstance(end, str) else end)
    return out


def offsets_of(spark, table):
    return sorted((r.topic, r.partition, r.offset) for r in spark.sql(f"select topic, partition, offset from {table}")
                  .collect())


def now_between_produce_calls():
    """A time T (ms) strictly after everything produced so far and before everything produced next."""
    time.sleep(0.05)
    t = int(time.time() * 1000)
    time.sleep(0.05)
    return t


def memory_query(df, name, checkpoint, trigger="500 milliseconds"):
    return (df.writeStream.format("memory").queryName(name).option("checkpointLocation", str(checkpoint))
            .trigger(processingTime=trigger).start())


def wait_rows(spark, q, table, n, timeout=60):
    def enough():
        assert q.exception() is None, q.exception()
        return spark.sql(f"select count(*) c from {table}").collect()[0].c >= n
    wait_until(enough, timeout=timeout, interval=0.2, what=f"{n} rows in {table}")


# -- 1. startingTimestamp / startingOffsetsByTimestamp / endingTimestamp --------------------------------

def test_starting_and_ending_timestamps(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"ts": {"numPartitions": 2}})
    parts = ["1-0", "1-1"]
    fill(cluster, "ts", 10, parts)                      # group A: offsets 0..9
    t1 = now_between_produce_calls()
    for p in parts:                                     # group B: offsets 10..16
        send(cluster, "ts", p, [b"B%d" % i for i in range(7)])
    t2 = now_between_produce_calls()
    for p in parts:                                     # group C: offsets 17..21
        send(cluster, "ts", p, [b"C%d" % i for i in range(5)])
    t3 = now_between_produce_calls()

    def offsets(**options):
        return sorted((r.partition, r.offset) for r in reader(spark, cluster, subscribe="ts", **options).collect())

    assert offsets(startingTimestamp=t1) == [(p, o) for p in parts for o in range(10, 22)]
    assert offsets(startingTimestamp=t2) == [(p, o) for p in parts for o in range(17, 22)]
    assert offsets(startingTimestamp=t1, endingTimestamp=t2) == [(p, o) for p in parts for o in range(10, 17)]
    assert offsets(endingTimestamp=t1) == [(p, o) for p in parts for o in range(0, 10)]
    by_ts = json.dumps({"ts": {"1-0": t1, "1-1": t2}})
    assert offsets(startingOffsetsByTimestamp=by_ts) == \
        [("1-0", o) for o in range(10, 22)] + [("1-1", o) for o in range(17, 22)]
    rows = reader(spark, cluster, subscribe="ts", startingTimestamp=t1, endingTimestamp=t2).collect()
    assert sorted(r.value for r in rows) == sorted(b"B%d" % i for i in range(7) for _ in parts)

    # No message at or after the time: 'error' (the default) fails naming it; 'latest' starts at the end.
    with pytest.raises(Exception, match=rf"no message at or after timestamp {t3} in ts 1-"):
        offsets(startingTimestamp=t3)
    with pytest.raises(Exception, match=rf"no message at or after timestamp {t3} in ts 1-1"):
        offsets(startingOffsetsByTimestamp=json.dumps({"ts": {"1-0": t1, "1-1": t3}}),
                startingOffsetsByTimestampStrategy="error")
    assert offsets(startingTimestamp=t3, startingOffsetsByTimestampStrategy="latest") == []
    assert offsets(startingOffsetsByTimestamp=json.dumps({"ts": {"1-0": t2, "1-1": t3}}),
                   startingOffsetsByTimestampStrategy="latest") == [("1-0", o) for o in range(17, 22)]

    # Streaming: AvailableNow from T reads exactly the later groups.
    df = reader(spark, cluster, streaming=True, subscribe="ts", startingTimestamp=t1)
    assert run_available_now(df, tmp_path / "ck1", name="ts_from_t1") == [24]
    assert offsets_of(spark, "ts_from_t1") == [("ts", p, o) for p in parts for o in range(10, 22)]
    df = reader(spark, cluster, streaming=True, subscribe="ts",
                startingOffsetsByTimestamp=json.dumps({"ts": {"1-0": t2, "1-1": t1}}))
    assert run_available_now(df, tmp_path / "ck2", name="ts_by_ts") == [17]
    assert offsets_of(spark, "ts_by_ts") == [("ts", "1-0", o) for o in range(17, 22)] + \
        [("ts", "1-1", o) for o in range(10, 22)]

    # Streaming with strategy latest and a time after everything: only what is produced later arrives.
    df = reader(spark, cluster, streaming=True, subscribe="ts", startingTimestamp=t3,
                startingOffsetsByTimestampStrategy="latest")
    q = memory_query(df, "ts_latest", tmp_path / "ck3")
    try:
        wait_until(lambda: q.recentProgress, timeout=60, what="first trigger")
        send(cluster, "ts", "1-0", [b"D0", b"D1"])
        q.processAllAvailable()
        wait_rows(spark, q, "ts_latest", 2)
        assert offsets_of(spark, "ts_latest") == [("ts", "1-0", 22), ("ts", "1-0", 23)]
    finally:
        q.stop()


# -- 2. startingOffsets=latest --------------------------------------------------------------------------

def test_streaming_from_latest_reads_only_new_messages(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"late": {"numPartitions": 2}})
    parts = ["1-0", "1-1"]
    fill(cluster, "late", 20, parts)
    df = reader(spark, cluster, streaming=True, subscribe="late", startingOffsets="latest")
    q = memory_query(df, "late_rows", tmp_path / "ck")
    try:
        wait_until(lambda: q.recentProgress, timeout=60, what="first trigger")
        q.processAllAvailable()
        assert offsets_of(spark, "late_rows") == []
        for p in parts:
            send(cluster, "late", p, [b"new-%s-%d" % (p.encode(), i) for i in range(5)])
        q.processAllAvailable()
        wait_rows(spark, q, "late_rows", 10)
        assert offsets_of(spark, "late_rows") == [("late", p, o) for p in parts for o in range(20, 25)]
        values = sorted(r.value for r in spark.sql("select value from late_rows").collect())
        assert values == sorted(b"new-%s-%d" % (p.encode(), i) for p in parts for i in range(5))
    finally:
        q.stop()


# -- 3. maxBytesPerTrigger ------------------------------------------------------------------------------

def test_max_bytes_per_trigger_splits_available_now(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"big": {"numPartitions": 2}})
    parts = ["1-0", "1-1"]
    for p in parts:
        send(cluster, "big", p, [b"%s:%04d:" % (p.encode(), i) + b"x" * 990 for i in range(100)])
    df = reader(spark, cluster, streaming=True, subscribe="big", maxBytesPerTrigger=50_000)
    counts = run_available_now(df, tmp_path / "ck", name="big_rows")
    assert sum(counts) == 200
    assert len(counts) >= 4, counts
    # Each message is ~1000 bytes: a 50 000-byte budget holds at most 50, and the budget is used well.
    assert all(n <= 50 for n in counts), counts
    assert all(n >= 40 for n in counts[:-1]), counts
    assert offsets_of(spark, "big_rows") == [("big", p, o) for p in parts for o in range(100)]

    # A budget smaller than one message still makes progress, one message per batch.
    df = reader(spark, cluster, streaming=True, subscribe="big", maxBytesPerTrigger=10,
                startingOffsets=json.dumps({"big": {"1-0": 97, "1-1": 98}}))
    assert run_available_now(df, tmp_path / "ck2", name="tiny_rows") == [1] * 5
    assert offsets_of(spark, "tiny_rows") == [("big", "1-0", o) for o in (97, 98, 99)] + \
        [("big", "1-1", o) for o in (98, 99)]


# -- 4. minOffsetsPerTrigger + maxTriggerDelay ----------------------------------------------------------

def _progress_time(p):
    return datetime.datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()


def test_min_offsets_per_trigger_waits_for_rows_or_the_delay(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"mins": {"numPartitions": 1}})
    df = reader(spark, cluster, streaming=True, subscribe="mins", minOffsetsPerTrigger=50, maxTriggerDelay="6s")
    q = memory_query(df, "min_rows", tmp_path / "ck")

    def data_batches():
        assert q.exception() is None, q.exception()
        return [p for p in q.recentProgress if p["numInputRows"]]
    try:
        wait_until(lambda: q.recentProgress, timeout=60, what="first trigger")
        send(cluster, "mins", "1-0", [b"a%d" % i for i in range(10)])
        time.sleep(1.5)  # several triggers: 10 < 50 rows and the delay has not passed, so no batch
        assert data_batches() == []
        send(cluster, "mins", "1-0", [b"b%d" % i for i in range(45)])
        first = wait_until(data_batches, timeout=30, interval=0.1, what="a batch once 55 rows wait")
        assert [p["numInputRows"] for p in first] == [55]
        send(cluster, "mins", "1-0", [b"c%d" % i for i in range(10)])
        time.sleep(2.5)  # fewer than the minimum: still nothing
        assert [p["numInputRows"] for p in data_batches()] == [55]
        both = wait_until(lambda: len(data_batches()) >= 2 and data_batches(), timeout=30, interval=0.1,
                          what="the delay to pass")
        assert [p["numInputRows"] for p in both] == [55, 10]
        waited = _progress_time(both[1]) - _progress_time(both[0])
        assert 5.0 <= waited <= 10.0, waited
        assert offsets_of(spark, "min_rows") == [("mins", "1-0", o) for o in range(65)]
    finally:
        q.stop()


# -- 5. new partitions and a topic across two brokers, while a query runs -------------------------------

def test_new_topics_and_partitions_are_picked_up(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"dyn-a": {"numPartitions": 1}, "other": {"numPartitions": 1}})
    fill(cluster, "dyn-a", 5, ["1-0"])
    fill(cluster, "other", 5, ["1-0"])
    df = reader(spark, cluster, streaming=True, subscribePattern="dyn-.*")
    q = memory_query(df, "dyn_rows", tmp_path / "ck")
    try:
        wait_rows(spark, q, "dyn_rows", 5)
        with cluster.client(Admin) as admin:
            created = admin.create_topic("dyn-b", num_partitions=2)
        assert sorted(created) == ["1-0", "1-1"]
        fill(cluster, "dyn-b", 7, ["1-0", "1-1"])
        wait_rows(spark, q, "dyn_rows", 5 + 14)
        # A broker joins with a partition of dyn-a: read from its earliest offset too.
        cluster.start_broker(2, topics={"dyn-a": {"numPartitions": 1}})
        fill(cluster, "dyn-a", 3, ["1-0", "2-0"])
        wait_rows(spark, q, "dyn_rows", 5 + 14 + 6)
        q.processAllAvailable()
        assert offsets_of(spark, "dyn_rows") == sorted(
            [("dyn-a", "1-0", o) for o in range(8)] + [("dyn-a", "2-0", o) for o in range(3)]
            + [("dyn-b", p, o) for p in ("1-0", "1-1") for o in range(7)])
    finally:
        q.stop()


def test_streaming_a_topic_across_two_brokers(spark, cluster, tmp_path):
    for bid in (1, 2):
        cluster.start_broker(bid, topics={"wide": {"numPartitions": 2}})
    parts = ["1-0", "1-1", "2-0", "2-1"]
    fill(cluster, "wide", 10, parts)
    df = reader(spark, cluster, streaming=True, subscribe="wide")
    q = memory_query(df, "wide_rows", tmp_path / "ck")
    try:
        wait_rows(spark, q, "wide_rows", 40)
        fill(cluster, "wide", 4, parts)
        wait_rows(spark, q, "wide_rows", 56)
        q.processAllAvailable()
        assert offsets_of(spark, "wide_rows") == [("wide", p, o) for p in parts for o in range(14)]
        rows = spark.sql("select partition, offset, value from wide_rows").collect()
        assert all(r.value == b"%s:%d" % (r.partition.encode(), r.offset if r.offset < 10 else r.offset - 10)
                   for r in rows)
    finally:
        q.stop()


# -- 6. Trigger.Once ------------------------------------------------------------------------------------

def test_trigger_once_reads_everything_despite_max_offsets(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"once": {"numPartitions": 2}})
    fill(cluster, "once", 30, ["1-0", "1-1"])
    df = reader(spark, cluster, streaming=True, subscribe="once", maxOffsetsPerTrigger=10)
    q = (df.writeStream.format("memory").queryName("once_rows").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(once=True).start())
    q.awaitTermination(120)
    assert q.exception() is None, q.exception()
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [60]
    assert offsets_of(spark, "once_rows") == [("once", p, o) for p in ("1-0", "1-1") for o in range(30)]


def test_a_schema_given_by_the_query_reads_only_its_columns(spark, cluster, tmp_path):
    """``.schema(...)`` with some of the source's columns, in any order: the rows hold those, right; a
    column metaq has not, or of another type, is refused by name."""
    cluster.start_broker(1, topics={"cols": {"numPartitions": 2}})
    fill(cluster, "cols", 20, ["1-0", "1-1"])

    def read(schema, streaming=False):
        r = (spark.readStream if streaming else spark.read).format("metaq").schema(schema)
        return r.option("metaq.zk.connect", cluster.zk_connect).option("metaq.zk.root", cluster.zk_root) \
            .option("subscribe", "cols").load()

    rows = read("offset long, value binary, partition string").collect()
    assert read("offset long, value binary, partition string").columns == ["offset", "value", "partition"]
    assert sorted((r.partition, r.offset, bytes(r.value)) for r in rows) == \
        [(p, i, b"%s:%d" % (p.encode(), i)) for p in ("1-0", "1-1") for i in range(20)]
    q = (read("value binary", streaming=True).writeStream.format("memory").queryName("cols_values")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert q.exception() is None, q.exception()
    assert sorted(bytes(r.value) for r in spark.sql("select value from cols_values").collect()) == \
        sorted(b"%s:%d" % (p.encode(), i) for p in ("1-0", "1-1") for i in range(20))
    for schema, message in (("value string", "column value is binary in metaq, not string"),
                            ("value binary, nope int", "metaq has no column 'nope'")):
        with pytest.raises(Exception, match=re.escape(message)):
            read(schema).collect()


# -- 7. ZooKeeper group offsets -------------------------------------------------------------------------

def _run_tracked(df, checkpoint, name):
    q = (df.writeStream.format("memory").queryName(name).option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    return q


def test_group_offsets_in_zookeeper_follow_committed_batches(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"grp": {"numPartitions": 2}, "nocommit": {"numPartitions": 2},
                                    "dflt": {"numPartitions": 1}})
    parts = ["1-0", "1-1"]
    fill(cluster, "grp", 60, parts)
    fill(cluster, "nocommit", 60, parts)
    fill(cluster, "dflt", 50, ["1-0"])

    q = _run_tracked(reader(spark, cluster, streaming=True, subscribe="grp", maxOffsetsPerTrigger=40,
                            group="g7"), tmp_path / "ck", "grp_rows")
    ends = [e["grp"] for e in end_offsets(q)]
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [40, 40, 40]
    assert ends[-1] == {"1-0": 60, "1-1": 60}
    with cluster.client(Consumer, group="g7") as consumer:
        committed = consumer.committed("grp")
    assert committed in ends, (committed, ends)
    assert all(committed[p] <= ends[-1][p] for p in parts)
    assert offsets_of(spark, "grp_rows") == [("grp", p, o) for p in parts for o in range(60)]

    # commitOffsets=false: nothing is written for the group.
    q = _run_tracked(reader(spark, cluster, streaming=True, subscribe="nocommit", maxOffsetsPerTrigger=40,
                            group="g-none", commitOffsets="false"), tmp_path / "ck2", "nocommit_rows")
    assert len(end_offsets(q)) == 3
    with cluster.client(Consumer, group="g-none") as consumer:
        assert consumer.committed("nocommit") == {}
    with cluster.client(Admin) as admin:
        assert "g-none" not in admin.groups()

    # The default group is spark-metaq-subscribe-<topic>-<12 hex digits of this query's own>.
    q = _run_tracked(reader(spark, cluster, streaming=True, subscribe="dflt", maxOffsetsPerTrigger=20),
                     tmp_path / "ck3", "dflt_rows")
    ends = [e["dflt"] for e in end_offsets(q)]
    assert ends == [{"1-0": 20}, {"1-0": 40}, {"1-0": 50}]
    group = end_offsets(q)[-1]["@metaq"]["group"]
    assert re.fullmatch(r"spark-metaq-subscribe-dflt-[0-9a-f]{12}", group), group
    with cluster.client(Consumer, group=group) as consumer:
        committed = consumer.committed("dflt")
    assert committed in ends, (committed, ends)


# -- 9. a broker restarted between two AvailableNow runs -------------------------------------------------

def test_broker_restart_between_available_now_runs(spark, cluster, tmp_path):
    topics = {"rs": {"numPartitions": 2}}
    cluster.start_broker(1, topics=topics)
    parts = ["1-0", "1-1"]
    fill(cluster, "rs", 50, parts)
    checkpoint, out = tmp_path / "ck", tmp_path / "out"
    df = reader(spark, cluster, streaming=True, subscribe="rs", maxOffsetsPerTrigger=40)
    assert run_available_now(df, checkpoint, path=out) == [40, 40, 20]
    for p in parts:
        send(cluster, "rs", p, [b"before-%d" % i for i in range(20)])  # offsets 50..69
    assert cluster.brokers[1].stop() == 0
    cluster.start_broker(1, topics=topics)
    for p in parts:
        send(cluster, "rs", p, [b"after-%d" % i for i in range(10)])   # offsets 70..79
    df = reader(spark, cluster, streaming=True, subscribe="rs", maxOffsetsPerTrigger=40)
    assert run_available_now(df, checkpoint, path=out) == [40, 20]
    rows = spark.read.parquet(str(out)).select("partition", "offset", "value").collect()
    assert sorted((r.partition, r.offset) for r in rows) == [(p, o) for p in parts for o in range(80)]
    expected = {o: (b"before-%d" % (o - 50) if 50 <= o < 70 else b"after-%d" % (o - 70) if o >= 70 else None)
                for o in range(80)}
    for r in rows:
        assert r.value == (expected[r.offset] or b"%s:%d" % (r.partition.encode(), r.offset))


# -- 8. local-cluster: executors in separate processes (last: it replaces the module's session) ---------

def test_batch_read_on_local_cluster(spark, cluster):
    from pyspark.sql import SparkSession

    import metaq_spark
    cluster.start_broker(1, topics={"lc": {"numPartitions": 2}})
    parts = ["1-0", "1-1"]
    fill(cluster, "lc", 500, parts)
    spark.stop()  # only one SparkContext per process
    assert SparkSession.getActiveSession() is None
    session = spark_builder("local-cluster[2,1,1024]", "metaq-local-cluster").config("spark.executor.memory", "512m") \
        .getOrCreate()
    try:
        session.sparkContext.setLogLevel("ERROR")
        metaq_spark.register(session)
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
        wait_until(lambda: status().size() == 3, timeout=90, what="2 executors")  # driver + 2 executors
        df = reader(session, cluster, subscribe="lc", minPartitions=4)
        rows = df.select("partition", "offset", "value").collect()
        assert sorted((r.partition, r.offset) for r in rows) == [(p, o) for p in parts for o in range(500)]
        assert all(r.value == b"%s:%d" % (r.partition.encode(), r.offset) for r in rows)
    finally:
        session.stop()
