"""Issue 5: the metaq Spark sink, ``df.write`` and ``df.writeStream``, exactly once. Real ZooKeeper,
broker processes and Spark; failures are injected at precise points (a UDF that pauses or fails on its
first attempt, SIGKILL of the driver process group, SIGSTOP/SIGKILL of a broker), and in every case the
output topic holds each input exactly once."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import Counter

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from pyspark import TaskContext
from pyspark.sql import functions as F
from spark_helpers import fill, reader

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.process import freeze
from metaq_broker.zk import decisions as txn_decisions
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children
from metaq_spark.options import OptionError, SinkOptions, parse_sink
from metaq_spark.sink import SinkSchemaError, check_schema

PER_PARTITION = 200


def expected(per_partition=PER_PARTITION):
    return Counter(f"out:{p}:{i}" for p in ("1-0", "1-1") for i in range(per_partition))


SPARK_MASTER = "local[2,4]"  # two task threads, and a failed task is tried up to 4 times (as on a cluster)


@pytest.fixture(autouse=True)
def _stop_queries(request):
    """A test that fails mid-query leaves no query running into the next test."""
    yield
    if "spark" in request.fixturenames:
        for q in request.getfixturevalue("spark").streams.active:
            q.stop()


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(10)
    yield client
    client.stop()
    client.close()


# -- helpers ---------------------------------------------------------------------------------------------

def pipeline(spark, zk_connect, root, checkpoint, hooks, route="hash", topic="out", **sink_options):
    """``in`` -> transformation -> ``topic``, AvailableNow in batches of 200 rows (100 per input partition).
    A file ``pause-<batch>-<partition>-<offset>`` in ``hooks`` makes that row's first visit write
    ``paused`` and wait for ``go``; ``fail-<batch>-<partition>-<offset>`` fails that row's task on its
    first attempt. route "split": rows of input 1-1 go to out 1-0 only, rows of 1-0 alternate 1-0/2-0."""
    for conf, value in (("arrow.maxRecordsPerBatch", 10), ("python.udf.maxRecordsPerBatch", 10),
                        ("python.udf.buffer.size", 256), ("pandas.udf.buffer.size", 256)):
        spark.conf.set(f"spark.sql.execution.{conf}", str(value))  # rows reach the sink as they go

    @F.udf("string")
    def transform(value, partition, offset):
        ctx = TaskContext.get()
        where = f"{ctx.getLocalProperty('streaming.sql.batchId')}-{partition}-{offset}"
        armed = os.path.join(hooks, f"pause-{where}")
        if os.path.exists(armed):
            os.remove(armed)
            open(os.path.join(hooks, "paused"), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(hooks, "go")) and time.time() < deadline:
                time.sleep(0.02)
        if ctx.attemptNumber() > 0:
            open(os.path.join(hooks, "retried"), "w").close()
        if os.path.exists(os.path.join(hooks, f"fail-{where}")) and ctx.attemptNumber() == 0:
            open(os.path.join(hooks, "failed"), "w").close()
            raise RuntimeError(f"injected failure at {where} on the first attempt")
        return "out:" + value

    df = (spark.readStream.format("metaq").option("metaq.zk.connect", zk_connect).option("metaq.zk.root", root)
          .option("subscribe", "in").option("maxOffsetsPerTrigger", 200).option("commitOffsets", "false").load())
    cols = [transform(F.col("value").cast("string"), "partition", "offset").alias("value")]
    if route == "split":
        cols.append(F.when(F.col("partition") == "1-1", "1-0").when(F.col("offset") % 2 == 0, "1-0")
                    .otherwise("2-0").alias("partition"))
    out = df.select(*cols).withColumn("key", F.col("value"))
    w = (out.writeStream.format("metaq").option("metaq.zk.connect", zk_connect).option("metaq.zk.root", root)
         .option("topic", topic).option("checkpointLocation", str(checkpoint)).trigger(availableNow=True))
    for k, v in sink_options.items():
        w = w.option(k, v)
    return w.start()


def start_brokers(cluster, out_brokers=(1, 2), timeout_ms=60_000, per_partition=PER_PARTITION):
    """``in`` (2 partitions) on broker 1; ``out`` with one partition on each of ``out_brokers``."""
    for bid in sorted({1, *out_brokers}):
        topics = {"out": {"numPartitions": 1}} if bid in out_brokers else {}
        if bid == 1:
            topics["in"] = {"numPartitions": 2}
        cluster.start_broker(bid, settings={"transactionTimeout": timeout_ms, "metricsPort": 0},
                             topics=topics)
    fill(cluster, "in", per_partition, ["1-0", "1-1"])
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("out")) == len(out_brokers), what="topic out")


def restart_broker(cluster, bid):
    b = cluster.brokers[bid]
    b.kill()
    cluster.start_broker(bid, settings=b.settings, topics=b.topics)


def topic_values(cluster, topic):
    """Every message of ``topic`` as the client sees it (all partitions, value as text)."""
    out = []
    with cluster.client(Consumer) as c:
        for p, (earliest, latest) in c.offsets(topic).items():
            if latest > earliest:
                out += [v.decode() for v in c.read_range(topic, p, earliest, latest).column("value").to_pylist()]
    return out


def prepared(cluster, bid, batch=None):
    """xids of prepared transactions on broker ``bid`` (of stream batch ``batch``)."""
    with cluster.client(Admin) as admin:
        xids = [t.xid for t in admin.prepared_transactions(bid)]
    return [x for x in xids if batch is None or x.split("/")[1] == str(batch)]


def open_transactions(broker):
    """Open (not yet prepared) transactions on a broker, from its Prometheus metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as r:
        m = re.search(r'metaq_open_transactions\{state="open"\} (\S+)', r.read().decode())
    return int(float(m.group(1))) if m else 0


def decisions(zk, root):
    """{sinkId: {batchId: Decision}} of every decision record under ``root``, read while the sinks make and
    remove them: a node gone (or not yet made) between two reads is absent (stop 39's run: a NoNodeError)."""
    paths = ZkPaths(root)
    return {sink: {int(b): txn_decisions.read(zk, paths.sink_batch(sink, int(b)))[0]
                   for b in children(zk, paths.sink_batches(sink))}
            for sink in children(zk, paths.sinks())}


def test_decisions_are_read_while_a_sink_makes_and_removes_them(zk, zk_root):
    """``decisions``, which the driver-crash tests poll while the sinks work: a sink whose batches node is
    not made yet, or that was removed between two reads, is read as it stands instead of a NoNodeError."""
    zk.ensure_path(f"{zk_root}/sinks/nightly")
    assert decisions(zk, zk_root) == {"nightly": {}}
    zk.delete(f"{zk_root}/sinks", recursive=True)
    assert decisions(zk, zk_root) == {}


def arm(hooks, name):
    hooks.mkdir(exist_ok=True)
    (hooks / name).touch()


def settled(cluster, topic):
    """No transaction holds back readers of ``topic``: last stable offset = log end everywhere."""
    with cluster.client(Consumer) as c:
        return all(stable == end for _, stable, end in c.offset_bounds(topic).values())


def assert_exactly_once(cluster, topic="out", per_partition=PER_PARTITION):
    # A failed task attempt's open transaction is rolled back once the batch's decision leaves it out
    # (within a resolver round); until then it holds readers back, as Kafka's read_committed does.
    wait_until(lambda: settled(cluster, topic), timeout=20, what=f"every transaction on {topic} settled")
    values, want = Counter(topic_values(cluster, topic)), expected(per_partition)
    assert values == want, f"missing {sum((want - values).values())}, duplicated {sum((values - want).values())}"
    for bid in cluster.brokers:  # leftovers of failed attempts and replays are rolled back
        wait_until(lambda b=bid: not prepared(cluster, b), timeout=20, what=f"no in-doubt transaction on {bid}")


def writer(df, cluster, **options):
    w = df.write.format("metaq").option("metaq.zk.connect", cluster.zk_connect).option("metaq.zk.root",
                                                                                       cluster.zk_root)
    for k, v in options.items():
        w = w.option(k, v)
    return w.mode("append")


# -- options, schema, batch writes -----------------------------------------------------------------------

def test_bad_options_and_columns_fail_before_any_task(spark, cluster, tmp_path):
    zk = {"metaq.zk.connect": cluster.zk_connect}
    for options, message in [
        ({"topic": "t"}, r"option metaq.zk.connect is required"),
        ({**zk, "topic": "t", "subscribe": "t"}, r"unknown option 'subscribe' for the metaq sink; known options: "),
        ({**zk, "deliveryGuarantee": "twice"}, r"option deliveryGuarantee: expected exactly-once or at-least-once"),
        ({**zk, "sinkId": "a/b"}, r"option sinkId: 'a/b' must be 1 to 64 characters"),
        ({**zk, "transactionTimeoutMs": "soon"}, r"option transactionTimeoutMs: 'soon' is not an integer"),
        ({**zk, "metaq.zk.root": "meta"}, r"option metaq.zk.root: 'meta' must start with '/'"),
        ({**zk, "topic": "a/b"}, r"option topic: topic 'a/b' cannot be used"),
    ]:
        with pytest.raises(OptionError, match=message):
            parse_sink(options)
    assert parse_sink({**zk, "checkpointLocation": "/ck", "path": "x", "DELIVERYGUARANTEE": "At-Least-Once"}) \
        == SinkOptions(cluster.zk_connect, exactly_once=False, checkpoint="/ck")
    for ddl, options, message in [
        ("value string", {}, r"no topic: give the option topic, or a string column 'topic'"),
        ("key string", {"topic": "t"}, r"the metaq sink needs a column 'value' \(binary or string\); got key"),
        ("value int", {"topic": "t"}, r"column 'value' has type int; the metaq sink needs binary or string"),
        ("value string, flag string", {"topic": "t"}, r"column 'flag' has type string; the metaq sink needs int"),
        ("value string, partition int", {"topic": "t"}, r"column 'partition' has type int; .* needs string"),
        ("value string, topic binary", {}, r"column 'topic' has type binary; the metaq sink needs string"),
        ("value string, offset long", {"topic": "t"},
         r"column 'offset' is not written by the metaq sink; the columns are: value \(binary or string, required\), "
         r"key \(binary or string\), partition \(string <brokerId>-<n>\), attribute \(string\), flag \(int\), "
         r"topic \(string\)"),
    ]:
        with pytest.raises(SinkSchemaError, match=message):
            check_schema(spark.createDataFrame([], ddl).schema, parse_sink({**zk, **options}))
    # Through Spark: save() and start() fail on the driver, before any task runs.
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    with pytest.raises(Exception, match=r"unknown option 'subscribe' for the metaq sink"):
        writer(spark.createDataFrame([("a",)], "value string"), cluster, topic="t", subscribe="t").save()
    with pytest.raises(Exception, match=r"column 'offset' is not written by the metaq sink"):
        writer(spark.createDataFrame([("a", 1)], "value string, offset long"), cluster, topic="t").save()
    with pytest.raises(Exception, match=r"column 'partition' has type int"):
        (spark.readStream.format("rate").load().select(F.col("value").cast("string").alias("value"),
                                                       F.lit(1).alias("partition"))
         .writeStream.format("metaq").option("metaq.zk.connect", cluster.zk_connect).option("topic", "t")
         .option("checkpointLocation", str(tmp_path / "ck")).start().awaitTermination(60))
    assert topic_values(cluster, "t") == []


def test_batch_write_and_read_back(spark, cluster, zk):
    cluster.start_broker(1, topics={"a": {"numPartitions": 2}, "b": {"numPartitions": 1}})
    cluster.start_broker(2, topics={"a": {"numPartitions": 1}})
    rows = [(f"v{i}".encode(), f"k{i % 7}" if i % 3 else None, ["1-0", "1-1", "2-0"][i % 3], f"n={i}", i % 5)
            for i in range(300)]
    df = spark.createDataFrame(rows, "value binary, key string, partition string, attribute string, flag int")
    writer(df.repartition(3), cluster, topic="a").save()
    got = reader(spark, cluster, subscribe="a").select("value", "key", "partition", "attribute", "flag").collect()
    assert sorted((r.value, r.key.decode() if r.key else None, r.partition, r.attribute, r.flag) for r in got) == \
        sorted(rows)
    # string values, a topic column (nulls take the topic option), key hash without a partition column
    mixed = spark.createDataFrame([(f"s{i}", ["a", "b", None][i % 3], f"key{i % 4}") for i in range(90)],
                                  "value string, topic string, key string")
    writer(mixed, cluster, topic="b", deliveryGuarantee="exactly-once").save()
    b = reader(spark, cluster, subscribe="b").select("value").collect()
    assert sorted(r.value.decode() for r in b) == sorted(f"s{i}" for i in range(90) if i % 3)
    by_key = reader(spark, cluster, subscribe="a").where(F.col("value").cast("string").startswith("s")) \
        .groupBy("key").agg(F.countDistinct("partition").alias("n")).collect()
    assert len(by_key) == 4 and all(r.n == 1 for r in by_key)  # one key, one partition
    # at-least-once: no transactions, same rows
    writer(spark.createDataFrame([(f"x{i}",) for i in range(50)], "value string"), cluster, topic="b",
           deliveryGuarantee="at-least-once").save()
    assert sorted(v for v in topic_values(cluster, "b") if v.startswith("x")) == sorted(f"x{i}" for i in range(50))
    assert decisions(zk, cluster.zk_root) == {}  # a write removes its record once committed
    assert prepared(cluster, 1) == [] and prepared(cluster, 2) == []


def test_bad_input_fails_the_whole_write_and_shows_nothing(spark, cluster, zk):
    # transactionTimeout 3 s: a good task cancelled after preparing (its result never reported) is rolled
    # back by its broker soon
    cluster.start_broker(1, settings={"transactionTimeout": 3000},
                         topics={"t": {"numPartitions": 2, "maxMessageSize": 1000}})
    good = [(f"ok{i}", "1-0") for i in range(100)]
    cases = [
        (good + [("bad", "1-7")], r"partition '1-7' is not a live partition of topic 't'"),
        (good + [("x" * 2000, "1-1")], r"message 0 of the batch is 2000 bytes .*the limit for topic t is 1000"),
        (good + [("no partition", None)], r"the partition column has nulls"),
    ]
    for rows, message in cases:  # two tasks: one has only good rows, and prepares them
        df = spark.createDataFrame(rows, "value string, partition string").repartition(2)
        with pytest.raises(Exception, match=message):
            writer(df, cluster, topic="t").save()
        assert topic_values(cluster, "t") == []  # the good task's prepared transactions were rolled back
    wait_until(lambda: not prepared(cluster, 1), timeout=20, what="nothing in doubt")
    assert topic_values(cluster, "t") == []
    assert all(d.outcome == "abort" for s in decisions(zk, cluster.zk_root).values() for d in s.values())


def test_uncommitted_and_rolled_back_messages_are_never_visible(spark, cluster, zk):
    cluster.start_broker(1, settings={"transactionTimeout": 2000}, topics={"t": {"numPartitions": 1}})
    path = f"{cluster.zk_root}/sinks/manual/batches/{0:020d}"
    with cluster.client(Producer) as p:
        wait_until(lambda: p.cluster.topic_partitions("t"), what="topic")
        pending = p.transaction("manual/pending")
        pending.send_batch("t", [b"pending"], partition="1-0")
        pending.prepare()
        gone = p.transaction("manual/gone")
        gone.send_batch("t", [b"gone"], partition="1-0")
        gone.prepare()
        gone.rollback()
        undecided = p.transaction("manual/undecided", coordinator=json.dumps({"path": path, "run": "r"}))
        undecided.send_batch("t", [b"undecided"], partition="1-0")
        undecided.prepare()
        p.send_batch("t", [b"plain"], partition="1-0")
        # Readers stop at the first unsettled transaction's batch (the last stable offset), so the plain
        # message written after it waits until that transaction settles.
        assert topic_values(cluster, "t") == []
        assert [r.value for r in reader(spark, cluster, subscribe="t").collect()] == []
        # No decision within transactionTimeout: the broker records an abort and rolls back.
        wait_until(lambda: prepared(cluster, 1) == ["manual/pending@1"], timeout=15, what="undecided rolled back")
        assert txn_decisions.read(zk, path)[0].aborted == ["r"]
        pending.rollback()
    assert [r.value for r in reader(spark, cluster, subscribe="t").collect()] == [b"plain"]
    assert topic_values(cluster, "t") == ["plain"]


# -- streaming pipeline in -> Spark -> out ---------------------------------------------------------------

def test_pipeline_exactly_once_across_batches_and_restarts(spark, cluster, zk, tmp_path):
    start_brokers(cluster)
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(tmp_path))
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [200, 200]
    assert_exactly_once(cluster)
    [(sink, batches)] = decisions(zk, cluster.zk_root).items()
    assert sorted(batches) == [0, 1] and all(d.outcome == "commit" for d in batches.values())
    # more input, same checkpoint: the same sink id, only the new rows, old records cleaned up
    with cluster.client(Producer) as p:
        for part in ("1-0", "1-1"):
            p.send_batch("in", [f"{part}:{i}".encode() for i in range(PER_PARTITION, 2 * PER_PARTITION)],
                         partition=part)
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(tmp_path))
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    values = Counter(topic_values(cluster, "out"))
    assert values == expected(2 * PER_PARTITION)
    assert list(decisions(zk, cluster.zk_root)) == [sink]
    assert sorted(decisions(zk, cluster.zk_root)[sink]) == [2, 3]
    # at-least-once into another topic
    with cluster.client(Admin) as admin:
        admin.create_topic("fast", 2, [1])
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck-fast", str(tmp_path), topic="fast",
                 deliveryGuarantee="at-least-once")
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert Counter(topic_values(cluster, "fast")) == values


def test_task_failing_on_its_first_attempt(spark, cluster, tmp_path):
    start_brokers(cluster)
    arm(tmp_path / "hooks", "fail-1-1-0-150")  # batch 1, input partition 1-0, offset 150: mid-task
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(tmp_path / "hooks"))
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert (tmp_path / "hooks" / "failed").exists()
    assert_exactly_once(cluster)


def test_a_batch_slower_than_the_brokers_timeout_but_within_the_sinks_completes_once(spark, cluster, tmp_path):
    """The sink's transactionTimeoutMs, not the brokers' transactionTimeout, limits how long a prepared
    transaction waits for its decision: a batch slower than the latter but within the former commits."""
    start_brokers(cluster, timeout_ms=2000)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause-1-1-1-100")  # batch 1's task of input 1-1 waits; the other task prepares
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(hooks), transactionTimeoutMs=60000)
    wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 1, batch=1), timeout=120,
               what="batch 1 half prepared")
    time.sleep(5)  # well past the brokers' transactionTimeout (and a resolver round)
    assert prepared(cluster, 1, batch=1), "the brokers gave up on the prepared transaction"
    (hooks / "go").touch()
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert_exactly_once(cluster)


def test_brokers_give_up_before_the_decision_then_a_restart_writes_once(spark, cluster, tmp_path):
    """The batch is slower than its transaction timeout (the sink option unset: the brokers'
    transactionTimeout): they roll the batch back and record it, the commit fails with an error naming
    the option to raise, and a restart from the checkpoint writes the batch once."""
    start_brokers(cluster, timeout_ms=3000)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause-1-1-1-100")  # batch 1's task of input 1-1 waits; the other task prepares
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(hooks))
    wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 1, batch=1), timeout=120,
               what="batch 1 half prepared")
    wait_until(lambda: not prepared(cluster, 1, batch=1), timeout=20, what="the brokers' abort")
    (hooks / "go").touch()
    with pytest.raises(Exception, match=r"rolled back run \w+'s transactions before the commit decision.*Raise "
                                        r"the sink option transactionTimeoutMs \(now unset"):
        q.awaitTermination(180)
    for bid in (1, 2):  # (and a SIGKILL of both) a patient timeout for the rerun
        b = cluster.brokers[bid]
        b.kill()
        cluster.start_broker(bid, settings={**b.settings, "transactionTimeout": 60000}, topics=b.topics)
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(hooks))
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert_exactly_once(cluster)


def test_a_second_query_reusing_a_sink_id_fails_loudly_and_drops_nothing(spark, cluster, zk, tmp_path):
    """Another query (a new checkpoint) with the same sinkId reaches batch ids the first one decided: it
    is not a replay of that query, so it fails naming the sink id and the other query, instead of
    rolling its batch back (silently dropping it) as if it were."""
    start_brokers(cluster)
    first = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck1", str(tmp_path), sinkId="shared")
    first.awaitTermination(180)
    assert first.exception() is None, first.exception()
    assert_exactly_once(cluster)
    with cluster.client(Admin) as admin:
        admin.create_topic("again", 1, [2])
    second = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck2", str(tmp_path), topic="again",
                      sinkId="shared")
    with pytest.raises(Exception, match=rf"sink id 'shared': batch 0 was already committed by another query "
                                        rf"\(id {first.id}, checkpoint {re.escape(str(tmp_path / 'ck1'))}\).*"
                                        rf"own sinkId option"):
        second.awaitTermination(180)
    assert topic_values(cluster, "again") == []  # nothing half-written, and the first query's output intact
    assert_exactly_once(cluster)


def test_broker_killed_during_prepare(spark, cluster, tmp_path):
    start_brokers(cluster)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause-1-1-0-150")  # batch 1, input 1-0, mid-task: its transactions are open
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(hooks),
                 transactionTimeoutMs=60000)
    wait_until(lambda: (hooks / "paused").exists() and open_transactions(cluster.brokers[2]), timeout=120,
               what="an open transaction on broker 2")
    restart_broker(cluster, 2)  # SIGKILL: the open transaction is lost; its task fails and is retried
    (hooks / "go").touch()
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert (hooks / "retried").exists()
    assert_exactly_once(cluster)


def test_broker_killed_during_commit(spark, cluster, zk, tmp_path):
    start_brokers(cluster)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause-1-1-1-100")
    q = pipeline(spark, cluster.zk_connect, cluster.zk_root, tmp_path / "ck", str(hooks), route="split")
    broker2 = cluster.brokers[2]
    wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 2, batch=1), timeout=120,
               what="batch 1 prepared on broker 2")
    freeze(broker2.proc.pid)  # the driver's commit will wait on it
    try:
        (hooks / "go").touch()
        wait_until(lambda: any(1 in s for s in decisions(zk, cluster.zk_root).values())
                   and not prepared(cluster, 1, batch=1), timeout=60, what="the decision, broker 1 committed")
    finally:
        restart_broker(cluster, 2)  # SIGKILL while stopped, mid-commit; its prepared transaction survives
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    assert_exactly_once(cluster)


# -- the driver killed -----------------------------------------------------------------------------------

DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from spark_helpers import spark_builder
    import metaq_spark
    from test_spark_sink import pipeline
    spark = spark_builder("local[2,4]", "sink-driver").getOrCreate()
    metaq_spark.register(spark)
    q = pipeline(spark, {zk!r}, {root!r}, {ck!r}, {hooks!r}, route={route!r})
    q.awaitTermination()
    print("DONE", flush=True)
""")


def run_driver(cluster, tmp_path, route):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(__file__), zk=cluster.zk_connect, root=cluster.zk_root,
                                    ck=str(tmp_path / "ck"), hooks=str(tmp_path / "hooks"), route=route))
    return subprocess.Popen([sys.executable, str(script)], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_driver(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def finish_driver(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "DONE" in out, err[-3000:]


def test_driver_killed_before_the_decision_and_while_committing(cluster, zk, tmp_path):
    """Two SIGKILLs of the driver process group, then a clean run: in batch 1 after one task prepared
    and before the decision; in batch 2 after the decision, with the commit done on broker 1 and waiting
    on broker 2 (SIGSTOPped), so Spark replays a batch whose decision is already recorded."""
    start_brokers(cluster, per_partition=300)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause-1-1-1-100")
    proc = run_driver(cluster, tmp_path, "split")
    try:
        wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 1, batch=1), timeout=180,
                   what="batch 1 half prepared")
    finally:
        kill_driver(proc)
    assert not any(1 in s for s in decisions(zk, cluster.zk_root).values())

    (hooks / "paused").unlink()
    arm(hooks, "pause-2-1-1-200")
    proc = run_driver(cluster, tmp_path, "split")  # replays batch 1 under a new run, then batch 2
    broker2 = cluster.brokers[2]
    try:
        wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 2, batch=2), timeout=180,
                   what="batch 2 prepared on broker 2")
        freeze(broker2.proc.pid)  # the commit reaches broker 1, then waits here
        try:
            (hooks / "go").touch()
            wait_until(lambda: any(2 in s for s in decisions(zk, cluster.zk_root).values())
                       and not prepared(cluster, 1, batch=2), timeout=60, what="the decision, broker 1 committed")
        finally:
            kill_driver(proc)
    finally:
        broker2.proc.send_signal(signal.SIGCONT)
    assert not (tmp_path / "ck" / "commits" / "2").exists()  # Spark will replay batch 2

    finish_driver(run_driver(cluster, tmp_path, "split"))  # finds the decision: commits it, drops its own
    assert_exactly_once(cluster, per_partition=300)


BATCH_DRIVER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from spark_helpers import spark_builder
    import metaq_spark
    from test_spark_sink import batch_frame
    spark = spark_builder("local[2,4]", "sink-batch-driver").getOrCreate()
    metaq_spark.register(spark)
    (batch_frame(spark, {hooks!r}).write.format("metaq").option("metaq.zk.connect", {zk!r})
     .option("metaq.zk.root", {root!r}).option("topic", "out").option("sinkId", "nightly").mode("append").save())
    print("DONE", flush=True)
""")


def batch_frame(spark, hooks):
    """200 rows ``v<i>`` in two tasks: task 0's go to out 2-0, task 1's to out 1-0; a file ``pause`` in
    ``hooks`` makes task 1 write ``paused`` at its 50th row and wait for ``go``."""
    @F.udf("string")
    def value(i):
        if i == 150 and os.path.exists(os.path.join(hooks, "pause")):
            os.remove(os.path.join(hooks, "pause"))
            open(os.path.join(hooks, "paused"), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(hooks, "go")) and time.time() < deadline:
                time.sleep(0.02)
        return f"v{i}"

    df = spark.range(0, 200, numPartitions=2)
    return df.select(value("id").alias("value"), F.when(F.col("id") < 100, "2-0").otherwise("1-0").alias("partition"))


def test_batch_write_with_a_sink_id_is_exactly_once_across_a_driver_crash(spark, cluster, zk, tmp_path):
    """A batch write with a sinkId whose driver is SIGKILLed after the decision was recorded (commit done
    on broker 1, broker 2 SIGSTOPped): rerunning the same write finishes that commit and writes nothing
    again, and leaves no decision record behind."""
    start_brokers(cluster)
    hooks = tmp_path / "hooks"
    arm(hooks, "pause")
    script = tmp_path / "batch_driver.py"
    script.write_text(BATCH_DRIVER.format(tests=os.path.dirname(__file__), hooks=str(hooks), zk=cluster.zk_connect,
                                          root=cluster.zk_root))
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    broker2 = cluster.brokers[2]
    try:
        wait_until(lambda: (hooks / "paused").exists() and prepared(cluster, 2), timeout=180,
                   what="task 0 prepared on broker 2")
        freeze(broker2.proc.pid)
        try:
            (hooks / "go").touch()
            wait_until(lambda: any(0 in s for s in decisions(zk, cluster.zk_root).values())
                       and not prepared(cluster, 1), timeout=60, what="the decision, broker 1 committed")
        finally:
            kill_driver(proc)
    finally:
        broker2.proc.send_signal(signal.SIGCONT)
    writer(batch_frame(spark, str(hooks)), cluster, topic="out", sinkId="nightly").save()
    assert Counter(topic_values(cluster, "out")) == Counter(f"v{i}" for i in range(200))
    for bid in cluster.brokers:
        wait_until(lambda b=bid: not prepared(cluster, b), timeout=20, what=f"no in-doubt transaction on {bid}")
    assert decisions(zk, cluster.zk_root) == {}


def test_small_arrow_batches_sent_together_keep_keys_topics_and_order(spark, cluster):
    """Arrow batches of 5 rows: those queued while a Put is under way go in one Put as a table of chunks
    (PUT_BYTES), with a topic column and keys; each key still lands in its hash partition, and each
    partition holds the task's rows in order, both guarantees."""
    import pyarrow as pa

    from metaq_broker.client.partitioner import partitions_for_keys
    from metaq_spark.pipeline import send_arrow
    cluster.start_broker(1, topics={"p": {"numPartitions": 2}, "q": {"numPartitions": 3}})
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "5")
    try:
        for guarantee in ("at-least-once", "exactly-once"):
            df = spark.range(0, 2000, numPartitions=1).select(
                F.format_string(f"{guarantee[0]}%05d", "id").alias("value"),
                F.when(F.col("id") % 2 == 0, "p").otherwise("q").alias("topic"),
                F.when(F.col("id") % 4 < 2, F.format_string("k%d", F.col("id") % 9)).alias("key"))
            writer(df, cluster, deliveryGuarantee=guarantee).save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    with cluster.client(Consumer) as c, cluster.client(Producer) as producer:
        for topic, parity in (("p", 0), ("q", 1)):
            names = producer.registered_partitions(topic)
            rows = []
            for p, (earliest, latest) in c.offsets(topic).items():
                t = c.read_range(topic, p, earliest, latest)
                values, keys = [v.decode() for v in t.column("value").to_pylist()], t.column("key").to_pylist()
                for g in "ae":
                    mine = [v for v in values if v[0] == g]
                    assert mine == sorted(mine)  # one task: its rows in order in each partition
                keyed = [k for k in keys if k is not None]
                if keyed:  # the hash partition of each key
                    assert {names[i] for i in partitions_for_keys(pa.array(keyed), len(names))} == {p}
                rows += values
            assert sorted(rows) == sorted(f"{g}{i:05d}" for g in "ae" for i in range(2000) if i % 2 == parity)
        # a table of several chunks, as the sender builds it, splits by topic and hashes keys per chunk
        batches = [pa.record_batch({"value": [b"t%d" % (3 * j + i) for i in range(3)],
                                    "topic": ["p", None, "q"], "key": [b"k1", None, b"k%d" % j]}) for j in range(4)]
        sent = []
        n = send_arrow(lambda *a, **kw: sent.append(producer.send_batch(*a, **kw)), pa.Table.from_batches(batches),
                       {"value": 0, "topic": 1, "key": 2}, "q")
        counts = Counter()
        for r in (r for rs in sent for r in rs):
            counts[r.topic] += r.count
        assert n == 12 and counts == {"p": 4, "q": 8} and len(sent) == 2  # one call per topic
        assert len(sent[0]) == 1  # topic p: every row has key k1, so one partition
