"""Issue 7: the consumer group's offsets in ZooKeeper follow Spark's commit log, the last batch
included, and never run ahead of it. Real ZooKeeper, brokers and Spark."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import wait_until
import cli
from pyspark.sql import functions as F
from spark_helpers import fill, reader, run_available_now

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer


def committed(cluster, group, topic):
    with cluster.client(Consumer, group=group) as consumer:
        return consumer.committed(topic)


def metaq_groups_cli(cluster, group):
    """``metaq groups GROUP`` as an operator runs it: {partition: lag}."""
    r = cli.metaq_on(cluster, "groups", group)
    assert r.returncode == 0, r.err
    out = r.out
    return {cols[2]: int(cols[5]) for cols in (line.split() for line in out.splitlines()[1:])}


def test_available_now_records_the_last_batch(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"an": {"numPartitions": 2}})
    fill(cluster, "an", 150, ["1-0", "1-1"])
    df = reader(spark, cluster, streaming=True, subscribe="an", maxOffsetsPerTrigger=100, group="g-an")
    assert run_available_now(df, tmp_path / "ck", name="an_rows") == [100, 100, 100]
    # commit() alone would leave the last batch out (Spark calls it one batch late).
    wait_until(lambda: committed(cluster, "g-an", "an") == {"1-0": 150, "1-1": 150}, timeout=10,
               what="the last batch's offsets in ZooKeeper")
    assert metaq_groups_cli(cluster, "g-an") == {"1-0": 0, "1-1": 0}


def test_trigger_once_and_commit_offsets_false(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"once": {"numPartitions": 1}})
    fill(cluster, "once", 40, ["1-0"])
    q = (reader(spark, cluster, streaming=True, subscribe="once", group="g-once").writeStream.format("memory")
         .queryName("once_rows").option("checkpointLocation", str(tmp_path / "ck1")).trigger(once=True).start())
    q.awaitTermination(120)
    wait_until(lambda: committed(cluster, "g-once", "once") == {"1-0": 40}, timeout=10, what="offsets")
    q = (reader(spark, cluster, streaming=True, subscribe="once", group="g-off", commitOffsets="false")
         .writeStream.format("memory").queryName("off_rows").option("checkpointLocation", str(tmp_path / "ck2"))
         .trigger(once=True).start())
    q.awaitTermination(120)
    assert spark.sql("select count(*) c from off_rows").first().c == 40
    time.sleep(2)  # give a (wrong) listener write time to land
    assert committed(cluster, "g-off", "once") == {}


def test_processing_time_query_catches_up_and_idles(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"pt": {"numPartitions": 2}})
    fill(cluster, "pt", 60, ["1-0", "1-1"])
    q = (reader(spark, cluster, streaming=True, subscribe="pt", group="g-pt").writeStream.format("memory")
         .queryName("pt_rows").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: committed(cluster, "g-pt", "pt") == {"1-0": 60, "1-1": 60}, timeout=60,
                   what="the first catch-up")
        with cluster.client(Producer) as producer:  # then nothing more: the stream goes idle caught up
            producer.send_batch("pt", [b"late"] * 25, partition="1-0")
        wait_until(lambda: committed(cluster, "g-pt", "pt") == {"1-0": 85, "1-1": 60}, timeout=30,
                   what="the idle stream's offsets")
        with cluster.client(Admin) as admin:
            assert [(r.partition, r.lag) for r in admin.group_lag("g-pt", "pt")] == [("1-0", 0), ("1-1", 0)]
        assert metaq_groups_cli(cluster, "g-pt") == {"1-0": 0, "1-1": 0}
        assert q.exception() is None
    finally:
        q.stop()
    assert spark.sql("select count(*) c from pt_rows").first().c == 145


def test_several_sources_and_queries_in_one_session(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"left": {"numPartitions": 1}, "right": {"numPartitions": 1}})
    fill(cluster, "left", 30, ["1-0"])
    fill(cluster, "right", 70, ["1-0"])
    union = reader(spark, cluster, streaming=True, subscribe="left", group="g-left").unionByName(
        reader(spark, cluster, streaming=True, subscribe="right", group="g-right", maxOffsetsPerTrigger=20))
    other = reader(spark, cluster, streaming=True, subscribe="right", group="g-other")
    queries = [w.trigger(availableNow=True).start() for w in (
        union.writeStream.format("memory").queryName("u_rows").option("checkpointLocation", str(tmp_path / "u")),
        other.writeStream.format("memory").queryName("o_rows").option("checkpointLocation", str(tmp_path / "o")))]
    for q in queries:
        q.awaitTermination(180)
        assert q.exception() is None
    for group, topic, end in (("g-left", "left", 30), ("g-right", "right", 70), ("g-other", "right", 70)):
        wait_until(lambda: committed(cluster, group, topic) == {"1-0": end}, timeout=10, what=f"{group}")


def test_a_failing_batch_is_never_recorded(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"bad": {"numPartitions": 1}})
    fill(cluster, "bad", 300, ["1-0"])

    @F.udf("long")
    def explode_at_150(offset):
        if offset == 150:
            raise ValueError("poison message at offset 150")
        return offset

    df = reader(spark, cluster, streaming=True, subscribe="bad", group="g-bad", maxOffsetsPerTrigger=100)
    q = (df.select(explode_at_150("offset").alias("o")).writeStream.format("memory").queryName("bad_rows")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="poison message"):
        q.awaitTermination(180)
    wait_until(lambda: committed(cluster, "g-bad", "bad") == {"1-0": 100}, timeout=10, what="batch 0's offsets")
    time.sleep(2)  # a wrong write of the failed batch would land by now
    assert committed(cluster, "g-bad", "bad") == {"1-0": 100}


DRIVER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from spark_helpers import spark_builder
    import metaq_spark
    spark = spark_builder("local[1]", "driver-crash").getOrCreate()
    metaq_spark.register(spark)

    def sink(df, batch_id):
        df.write.mode("append").parquet({out!r})
        if batch_id == 1 and os.path.exists({kill!r}):  # output written, commit log not yet
            os.remove({kill!r})
            os.killpg(0, signal.SIGKILL)

    q = (spark.readStream.format("metaq").option("metaq.zk.connect", {zk!r}).option("metaq.zk.root", {root!r})
         .option("subscribe", "crash").option("group", "g-crash").option("maxOffsetsPerTrigger", 100).load()
         .writeStream.foreachBatch(sink).option("checkpointLocation", {ck!r}).trigger(availableNow=True).start())
    q.awaitTermination()
""")


def test_driver_killed_between_sink_commit_and_commit_log(cluster, tmp_path):
    cluster.start_broker(1, topics={"crash": {"numPartitions": 1}})
    fill(cluster, "crash", 300, ["1-0"])
    kill = tmp_path / "kill-at-batch-1"
    kill.touch()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=os.path.dirname(__file__), out=str(tmp_path / "out"), kill=str(kill),
                                    zk=cluster.zk_connect, root=cluster.zk_root, ck=str(tmp_path / "ck")))

    def run():
        return subprocess.run([sys.executable, str(script)], start_new_session=True, capture_output=True,
                              text=True, timeout=300)

    crashed = run()
    assert crashed.returncode == -9 and not kill.exists(), crashed.stderr[-3000:]
    # Batch 1 reached the sink but not Spark's commit log: only batch 0 is recorded.
    time.sleep(1)
    assert committed(cluster, "g-crash", "crash") == {"1-0": 100}

    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(committed(cluster, "g-crash", "crash").get("1-0"))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        restarted = run()
    finally:
        done.set()
        watcher.join()
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert committed(cluster, "g-crash", "crash") == {"1-0": 300}
    assert seen == sorted(seen) and seen[0] == 100, seen  # never backwards
