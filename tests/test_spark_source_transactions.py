"""The Spark source over a topic that transactions write into: a stream reading while transactions
commit and roll back around it gets exactly the committed messages, each once, and no aborted one."""
import json
import random
import threading
import time
from collections import Counter

from conftest import wait_until
from pyspark.sql import functions as F
from spark_helpers import reader

from metaq_broker.client import Consumer, Producer

PARTS = ("1-0", "1-1")


def produce(cluster, committed: Counter, rounds=40):
    rng = random.Random(3)
    with cluster.client(Producer) as p:
        for i in range(rounds):
            t = p.transaction(f"w/{i}")
            values = {part: [f"{i}:{part}:{k}" for k in range(rng.randint(1, 60))] for part in PARTS}
            for part, vs in values.items():
                t.send_batch("t", [v.encode() for v in vs], partition=part)
            p.send_batch("t", [f"plain{i}".encode()], partition=PARTS[i % 2])  # waits behind the transaction
            committed[f"plain{i}"] += 1
            if rng.random() < 0.5:
                t.prepare()
            if rng.random() < 0.6:
                t.prepare()
                t.commit()
                committed.update(v for vs in values.values() for v in vs)
            else:
                t.rollback()
            time.sleep(rng.random() * 0.1)


def test_a_stream_reading_while_transactions_commit_and_roll_back_gets_exactly_the_committed(spark, cluster,
                                                                                             tmp_path):
    cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions("t")) == 2, what="topic")
    stream = reader(spark, cluster, streaming=True, subscribe="t", startingOffsets="earliest",
                    maxOffsetsPerTrigger=150)
    q = (stream.select(F.col("value").cast("string").alias("value")).writeStream.format("memory")
         .queryName("txn_stream").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        committed = Counter()
        writer = threading.Thread(target=produce, args=(cluster, committed))
        writer.start()
        writer.join(180)
        assert not writer.is_alive()
        with cluster.client(Consumer) as c:
            ends = {p: end for p, (_, stable, end) in c.offset_bounds("t").items()}
            assert all(stable == ends[p] for p, (_, stable, _) in c.offset_bounds("t").items())

        def read_to_the_end():
            progress = q.lastProgress
            if q.exception() is not None or not progress:
                return False
            end = progress["sources"][0]["endOffset"]
            end = json.loads(end) if isinstance(end, str) else end
            return {p: int(v) for p, v in (end or {}).get("t", {}).items()} == ends
        wait_until(read_to_the_end, timeout=120, what="the stream at the log end")
        got = Counter(r.value for r in spark.sql("select value from txn_stream").collect())
        assert got == committed, (f"missing {sum((committed - got).values())}, "
                                  f"extra {sum((got - committed).values())}")
        assert len(q.recentProgress) > 3  # it read while the transactions went on
    finally:
        q.stop()
