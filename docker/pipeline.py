"""The docker-compose example job: make sure topics ``events`` and ``events-upper`` exist, produce some
messages into ``events``, then let a Spark streaming query read ``events`` through the metaq source,
upper-case each value and write it to ``events-upper``; exit 0 once the output topic holds as many
messages as the input one.

The query runs with ``trigger(availableNow=True)`` so the job ends (a compose run finishes with an exit
code) and keeps its checkpoint in PIPELINE_CHECKPOINT: a rerun reads only what arrived since. Until the
metaq Spark sink exists, each micro-batch goes out through the metaq Producer in ``foreachBatch``.

Environment: METAQ_ZK (zookeeper:2181), METAQ_ZK_ROOT (/meta), PIPELINE_BROKERS (brokers to wait for,
1: a replicated group counts once), PIPELINE_MESSAGES (messages to produce, 1000), PIPELINE_CHECKPOINT
(/var/lib/metaq-job/checkpoint).
"""
from __future__ import annotations

import os
import sys
import time

from metaq_broker.client import Admin, Consumer, Producer

IN_TOPIC, OUT_TOPIC = "events", "events-upper"


def wait_for(what: str, predicate, timeout: float = 120.0) -> None:
    """Brokers register and topics reach clients asynchronously (ZooKeeper); wait, then fail loudly."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - not there yet
            pass
        if time.monotonic() > deadline:
            sys.exit(f"pipeline: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def total(consumer: Consumer, topic: str) -> int:
    """Messages in ``topic``, read back: offsets would count a replicated group's epoch markers too."""
    return sum(consumer.read_range(topic, name, start, end).num_rows
               for name, (start, end) in consumer.offsets(topic).items())


def main() -> None:
    zk = os.environ.get("METAQ_ZK", "zookeeper:2181")
    zk_root = os.environ.get("METAQ_ZK_ROOT", "/meta")
    brokers = int(os.environ.get("PIPELINE_BROKERS", "1"))
    messages = int(os.environ.get("PIPELINE_MESSAGES", "1000"))
    checkpoint = os.environ.get("PIPELINE_CHECKPOINT", "/var/lib/metaq-job/checkpoint")

    with Admin(zk_connect=zk, zk_root=zk_root) as admin, Producer(zk_connect=zk, zk_root=zk_root) as producer:
        # a group counts once it has a master: only a master takes topics and puts
        wait_for(f"{brokers} brokers with a master in ZooKeeper", lambda: len(admin.masters()) >= brokers)
        print(f"pipeline: brokers {admin.masters()}", flush=True)
        for topic in (IN_TOPIC, OUT_TOPIC):
            if topic not in admin.topics():
                admin.create_topic(topic, 2)  # 2 partitions on every live broker
            count = 2 * brokers
            wait_for(f"{count} partitions of {topic}", lambda t=topic: len(producer.partitions(t)) >= count)
        for start in range(0, messages, 500):
            n = min(500, messages - start)
            producer.send_batch(IN_TOPIC, [b"event %d from the pipeline" % (start + i) for i in range(n)],
                               keys=[b"key-%d" % ((start + i) % 10) for i in range(n)])
        print(f"pipeline: produced {messages} messages into {IN_TOPIC}", flush=True)

        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        import metaq_spark

        spark = (SparkSession.builder.master("local[2]").appName("metaq-docker-pipeline")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("WARN")
        try:
            metaq_spark.register(spark)
            upper = (spark.readStream.format("metaq").option("metaq.zk.connect", zk)
                     .option("metaq.zk.root", zk_root).option("subscribe", IN_TOPIC)
                     .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", 10000).load()
                     .select("key", F.upper(F.col("value").cast("string")).alias("value")))

            def write_batch(batch_df, batch_id):
                table = batch_df.toArrow()
                if table.num_rows:
                    producer.send_batch(OUT_TOPIC, table.column("value").combine_chunks(),
                                        keys=table.column("key").combine_chunks())
                print(f"pipeline: batch {batch_id}: {table.num_rows} rows to {OUT_TOPIC}", flush=True)

            query = (upper.writeStream.foreachBatch(write_batch).trigger(availableNow=True)
                     .option("checkpointLocation", checkpoint).start())
            query.awaitTermination()
        finally:
            spark.stop()
        with Consumer(zk_connect=zk, zk_root=zk_root) as consumer:
            got, want = total(consumer, OUT_TOPIC), total(consumer, IN_TOPIC)
        print(f"pipeline: {IN_TOPIC} holds {want} messages, {OUT_TOPIC} {got}", flush=True)
        if got != want:
            sys.exit(f"pipeline: {OUT_TOPIC} holds {got} messages, expected {want}")


if __name__ == "__main__":
    main()
