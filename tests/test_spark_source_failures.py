"""A broker that goes away in the middle of a Spark read, with real Spark, ZooKeeper and broker processes.

The read is made of hundreds of small fetches (``fetchMaxBytes`` at its minimum). Once the broker has
served a few of them it is frozen (SIGSTOP), so the read cannot finish behind the test's back, then
killed (SIGKILL): the fetch in flight breaks and every later one finds no broker. Either the broker
comes back and the task carries on where it was, or the task gives up after ``fetchTimeoutMs`` with an
error naming the partition and the broker. A restart from the checkpoint then reads exactly what is
missing. No step depends on how fast anything runs: the checks that the outage really fell inside the
read (the query is still running with the broker frozen, the restarted broker serves fetches of it) are
assertions."""
import threading

import pytest
from conftest import wait_until
from pyspark.errors import StreamingQueryException
from spark_helpers import fill, reader, run_available_now

from metaq_broker.client.admin import Admin
from metaq_broker.devtools.process import freeze

PARTS = ["1-0", "1-1"]


def topic_settings(name):
    # Acknowledged after the write to the page cache, which a killed process cannot lose: filling is quick.
    return {name: {"numPartitions": 2, "unflushThreshold": 1000}}


def fetches_served(admin, topic) -> int:
    return sum(p.gets for p in admin.stats(1, topic).partitions)


def freeze_then_kill_mid_read(cluster, admin, topic, still_running):
    """Wait until the read has made a few fetches, freeze the broker, check that the read has not
    finished, then kill the broker."""
    baseline = fetches_served(admin, topic)
    wait_until(lambda: fetches_served(admin, topic) >= baseline + 5, timeout=120, interval=0.005,
               what="the read's first fetches")
    broker = cluster.brokers[1]
    freeze(broker.proc.pid)
    assert still_running(), "the read finished before the broker was frozen; make it longer"
    broker.kill()


def expected_rows(per_partition, second_fill_from=None):
    """(partition, offset, value) of the whole topic as ``fill`` wrote it, once or twice."""
    def value(p, o):
        return b"%s:%d" % (p.encode(), o if second_fill_from is None or o < second_fill_from else o - second_fill_from)
    return sorted((p, o, value(p, o)) for p in PARTS for o in range(per_partition))


def test_batch_read_waits_for_a_broker_killed_mid_read_and_returns_exact_rows(spark, cluster):
    topics = topic_settings("flaky")
    cluster.start_broker(1, topics=topics)
    fill(cluster, "flaky", 8000, PARTS, batch=10)  # 800 batches a partition, 4 to a 1 KiB fetch
    df = reader(spark, cluster, subscribe="flaky", fetchMaxBytes=1024)
    result = {}

    def collect():
        try:
            result["rows"] = df.select("partition", "offset", "value").collect()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    with cluster.client(Admin) as admin:
        reading = threading.Thread(target=collect)
        reading.start()
        freeze_then_kill_mid_read(cluster, admin, "flaky", reading.is_alive)
        cluster.start_broker(1, topics=topics)  # same port, same data
        reading.join(300)
        assert not reading.is_alive() and "error" not in result, result.get("error")
        assert fetches_served(admin, "flaky") > 0  # the tasks went on reading from the restarted broker
    assert sorted((r.partition, r.offset, r.value) for r in result["rows"]) == expected_rows(8000)


def test_stream_fails_naming_the_partition_then_resumes_exactly_from_its_checkpoint(spark, cluster, tmp_path):
    topics = topic_settings("crash")
    cluster.start_broker(1, topics=topics)
    fill(cluster, "crash", 1000, PARTS, batch=10)
    checkpoint, out = tmp_path / "ck", tmp_path / "out"

    def stream():
        return reader(spark, cluster, streaming=True, subscribe="crash", fetchMaxBytes=1024, fetchTimeoutMs=3000)

    assert run_available_now(stream(), checkpoint, path=out) == [2000]
    fill(cluster, "crash", 8000, PARTS, batch=10)  # offsets 1000..8999: one batch of 800 fetches a partition
    address = cluster.brokers[1].address
    with cluster.client(Admin) as admin:
        query = (stream().writeStream.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True)
                 .format("parquet").option("path", str(out)).start())
        freeze_then_kill_mid_read(cluster, admin, "crash", lambda: query.isActive)
        with pytest.raises(StreamingQueryException) as failed:
            query.awaitTermination(180)
    error = str(failed.value)
    assert "fetchTimeoutMs=3000" in error and address in error, error
    assert "crash 1-0 at offset" in error or "crash 1-1 at offset" in error, error

    cluster.start_broker(1, topics=topics)
    assert run_available_now(stream(), checkpoint, path=out) == [16000]  # the failed batch, read again
    rows = spark.read.parquet(str(out)).select("partition", "offset", "value").collect()
    assert sorted((r.partition, r.offset, r.value) for r in rows) == expected_rows(9000, second_fill_from=1000)
