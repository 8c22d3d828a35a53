"""Issue 14: a Spark pipeline metaq -> Spark -> metaq on a replicated broker group, its master killed
(kill -9) several times while the query runs. The source's tasks and planning, the sink's tasks and the
driver's settlement find each new master by themselves; the query does not fail, and the output topic
holds every input message exactly once."""
import time
from collections import Counter

import pytest
from conftest import wait_until
from pyspark.sql import functions as F

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.group import BrokerGroup

CHUNK = 750  # per partition, fed before the run and after each kill
TOPICS = {"in": {"numPartitions": 2}, "out": {"numPartitions": 2}}


SPARK_MASTER = "local[2,4]"  # two task threads, and a failed task is tried up to 4 times (as on a cluster)


def values_of(consumer, topic) -> Counter:
    out = Counter()
    for p, (start, end) in consumer.offsets(topic).items():
        if end > start:
            out.update(v.decode() for v in consumer.read_range(topic, p, start, end).column("value").to_pylist())
    return out


def settled(consumer, topic) -> bool:
    return all(stable == end for _, stable, end in consumer.offset_bounds(topic).values())


def test_exactly_once_pipeline_through_master_kills(spark, tmp_path, zookeeper, zk_root):
    """Before each kill the input gets another CHUNK messages, so the query (an ordinary trigger, which never
    ends by itself) always has batches to run when the master dies: the three kills land in a running query
    however fast or slow the machine is. The query is stopped once the output holds the whole input."""
    group = BrokerGroup(tmp_path / "group", 1, zookeeper.connect_string, zk_root, members=3, topics=TOPICS,
                        settings={"transactionTimeout": 60_000}).start()
    sent = []
    try:
        group.wait_master()
        group.wait_in_sync(range(3))

        def feed():
            with Producer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as producer:
                wait_until(lambda: len(producer.cluster.topic_partitions("in")) == 2, what="topic in routed")
                for p in ("1-0", "1-1"):
                    values = [f"{p}:{len(sent)}:{i}".encode() for i in range(CHUNK)]
                    producer.send_batch("in", values, partition=p)
                sent.append(2 * CHUNK)

        feed()

        @F.udf("string")
        def slow(value):
            time.sleep(0.002)  # the query runs for a while: the kills land in the middle of batches
            return "out:" + value

        df = (spark.readStream.format("metaq").option("metaq.zk.connect", zookeeper.connect_string)
              .option("metaq.zk.root", zk_root).option("subscribe", "in").option("maxOffsetsPerTrigger", 300)
              .option("commitOffsets", "false").load())
        out = df.select(slow(F.col("value").cast("string")).alias("value"))
        q = (out.writeStream.format("metaq").option("metaq.zk.connect", zookeeper.connect_string)
             .option("metaq.zk.root", zk_root).option("topic", "out")
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="200 milliseconds")
             .start())
        try:
            batch = 0
            for _ in range(3):
                batch += 2
                wait_until(lambda: q.lastProgress is not None and q.lastProgress["batchId"] >= batch
                           or not q.isActive, timeout=180, what=f"batch {batch}")
                assert q.isActive, q.exception()
                master = group.wait_master(timeout=30)
                group.members[master].kill()
                group.wait_master(timeout=30, other_than=master)
                group.members[master].start()  # it rejoins as a replica and catches up
                group.wait_in_sync(range(3), timeout=60)
                batch = q.lastProgress["batchId"] if q.lastProgress else batch
                feed()
            assert group.state()["epoch"] >= 4

            with Consumer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as consumer:
                wait_until(lambda: not q.isActive or settled(consumer, "out")
                           and sum(values_of(consumer, "out").values()) >= sum(sent),
                           timeout=300, interval=1, what="the whole input written to out")
                assert q.isActive, q.exception()
                q.stop()
                assert q.exception() is None, q.exception()
                values = values_of(consumer, "out")
                inputs = values_of(consumer, "in")
        finally:
            q.stop()
        assert sum(inputs.values()) == sum(sent)
        want = Counter("out:" + v for v in inputs.elements())
        assert values == want, (f"missing {sum((want - values).values())}, "
                                f"duplicated {sum((values - want).values())}")
    finally:
        group.stop()
