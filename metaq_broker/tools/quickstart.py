"""``metaq quickstart``: a local ZooKeeper and one broker in a work directory, a topic, sample data
produced and read back, a consumer group's lag; everything stopped and (for a temporary directory)
removed on exit."""
from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import click

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.zookeeper import LocalZooKeeper

TOPIC = "quickstart-events"
OUT_TOPIC = "quickstart-upper"
GROUP = "quickstart-readers"


def say(text: str) -> None:
    click.echo(click.style("» ", fg="green") + text)


def run(workdir: Optional[Path], messages: int, keep_running: bool = False, spark: bool = True) -> dict:
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="metaq-quickstart-")) if temporary else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    zk = broker = None
    try:
        say(f"work directory {workdir}")
        zk = LocalZooKeeper(data_dir=workdir / "zookeeper")
        zk.start()
        say(f"ZooKeeper is up at {zk.connect_string}")
        broker = BrokerProcess(workdir / "broker", broker_id=0, zk_connect=zk.connect_string,
                               settings={"numPartitions": 4}).start()
        say(f"broker 0 is up at {broker.address} (log: {broker.log_path})")
        with Admin(zk_connect=zk.connect_string) as admin, Producer(zk_connect=zk.connect_string) as producer, \
                Consumer(zk_connect=zk.connect_string, group=GROUP) as consumer:
            deadline = time.monotonic() + 15
            while not admin.brokers() and time.monotonic() < deadline:
                time.sleep(0.1)
            parts = admin.create_topic(TOPIC, 4)
            say(f"created topic {TOPIC} with partitions {', '.join(parts)}")
            _wait_for_partitions(producer, TOPIC, len(parts))

            started = time.monotonic()
            with click.progressbar(length=messages, label="producing") as bar:
                sent = 0
                while sent < messages:
                    n = min(1000, messages - sent)
                    keys = [b"user-%d" % ((sent + i) % 50) for i in range(n)]
                    values = [b'{"event": %d, "user": "user-%d"}' % (sent + i, (sent + i) % 50) for i in range(n)]
                    producer.send_batch(TOPIC, values, keys=keys)
                    sent += n
                    bar.update(n)
            elapsed = time.monotonic() - started
            say(f"produced {messages} messages in {elapsed:.2f}s ({messages / elapsed:,.0f} msgs/s), "
                f"each acknowledged after an fsync (group commit)")

            counts = Counter()
            offsets = consumer.offsets(TOPIC)
            for p, (earliest, latest) in sorted(offsets.items()):
                table = consumer.read_range(TOPIC, p, earliest, latest)
                counts[p] = table.num_rows
            say("read back per partition: " + ", ".join(f"{p}: {n}" for p, n in sorted(counts.items())))
            first = consumer.fetch(TOPIC, parts[0], 0, max_messages=3).messages()
            for m in first:
                say(f"  {m.partition} offset {m.offset} key {m.key.decode()} value {m.value.decode()}")
            consumer.commit(TOPIC, {p: latest for p, (_, latest) in offsets.items()})
            lag = sum(row.lag for row in admin.group_lag(GROUP, TOPIC))
            say(f"group {GROUP} committed its offsets in ZooKeeper; total lag {lag}")
            if sum(counts.values()) != messages:
                raise RuntimeError(f"read {sum(counts.values())} messages back, expected {messages}")
            if spark:
                piped = _spark_pipeline(zk.connect_string, workdir, admin, producer, consumer)
                if piped != messages:
                    raise RuntimeError(f"the Spark pipeline wrote {piped} messages, expected {messages}")
            if keep_running:
                say(f"leaving ZooKeeper ({zk.connect_string}) and the broker running; Ctrl-C stops them")
                try:
                    while True:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
            return {"produced": messages, "consumed": sum(counts.values()), "lag": lag}
    finally:
        if broker is not None:
            broker.stop()
        if zk is not None:
            zk.stop()
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        say("stopped the broker and ZooKeeper" + (" and removed the work directory" if temporary else ""))


def _spark_pipeline(zk_connect: str, workdir: Path, admin, producer, consumer) -> int:
    """Spark reads the topic as a stream, upper-cases each value and writes it to a second topic through
    the exactly-once metaq sink (broker transactions, decision records in ZooKeeper)."""
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # lazy: pyspark is heavy (a JVM), and only this step of the quickstart needs it
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import metaq_spark
    from metaq_spark.group_commit import RECORDER

    admin.create_topic(OUT_TOPIC, 2)
    _wait_for_partitions(producer, OUT_TOPIC, 2)
    say("starting Spark (local[2]) ...")
    spark = (SparkSession.builder.master("local[2]").appName("metaq-quickstart").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        metaq_spark.register(spark)
        source = (spark.readStream.format("metaq").option("metaq.zk.connect", zk_connect)
                  .option("subscribe", TOPIC).option("maxOffsetsPerTrigger", 4000).load())
        upper = source.select("key", F.upper(F.col("value").cast("string")).alias("value"))
        started = time.monotonic()
        query = (upper.writeStream.format("metaq").option("metaq.zk.connect", zk_connect)
                 .option("topic", OUT_TOPIC).trigger(availableNow=True)
                 .option("checkpointLocation", str(workdir / "spark-checkpoint")).start())
        query.awaitTermination()
        batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        elapsed = time.monotonic() - started
        say(f"Spark read {sum(batches)} messages from {TOPIC} in {len(batches)} micro-batches "
            f"({', '.join(map(str, batches))} rows) and wrote them upper-cased, exactly once, to {OUT_TOPIC} "
            f"in {elapsed:.1f}s")
        out = consumer.offsets(OUT_TOPIC)
        # rows, not offsets: each transaction's commit marker takes an offset in every partition it wrote
        written = sum(consumer.read_range(OUT_TOPIC, p, earliest, latest).num_rows
                      for p, (earliest, latest) in out.items())
        sample = consumer.fetch(OUT_TOPIC, sorted(out)[0], 0, max_messages=1).messages()
        if sample:
            say(f"  {sample[0].partition} offset 0: {sample[0].value.decode()}")
        say(f"{OUT_TOPIC} now holds {written} messages")
        return written
    finally:
        spark.stop()
        RECORDER.close()  # its ZooKeeper session ends before ZooKeeper does


def _wait_for_partitions(client, topic: str, count: int, timeout: float = 15.0) -> None:
    """ZooKeeper watches deliver the new topic to clients asynchronously; wait until they have it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(client.partitions(topic)) >= count:
                return
        except Exception:  # noqa: BLE001 - not visible yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} did not appear in ZooKeeper within {timeout}s")
        time.sleep(0.05)
