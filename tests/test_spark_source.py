"""The Spark source against real Spark (local mode), a real ZooKeeper and real brokers."""
import json

import pytest
from conftest import wait_until
from spark_helpers import fill, reader, run_available_now

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer


def test_batch_read_across_two_brokers(spark, cluster):
    for bid in (1, 2):
        cluster.start_broker(bid, topics={"orders": {"numPartitions": 2}})
    parts = ["1-0", "1-1", "2-0", "2-1"]
    fill(cluster, "orders", 25, parts)
    df = reader(spark, cluster, subscribe="orders")
    assert [f.name for f in df.schema.fields] == ["key", "value", "topic", "partition", "offset", "timestamp",
                                                 "timestampType", "msgId", "flag", "attribute"]
    rows = df.collect()
    assert sorted(r.value for r in rows) == sorted(b"%s:%d" % (p.encode(), i) for p in parts for i in range(25))
    assert {r.topic for r in rows} == {"orders"}
    for r in rows:
        assert r.value == b"%s:%d" % (r.partition.encode(), r.offset)
    ranged = reader(spark, cluster, subscribe="orders", startingOffsets=json.dumps({"orders": {"1-0": 5, "2-1": -2}}),
                    endingOffsets=json.dumps({"orders": {"1-0": 10, "2-1": 3}})).collect()
    assert sorted((r.partition, r.offset) for r in ranged) == [("1-0", o) for o in range(5, 10)] + \
        [("2-1", o) for o in range(3)]
    assert reader(spark, cluster, subscribe="orders", minPartitions=8).rdd.getNumPartitions() >= 8


@pytest.mark.parametrize("options,message", [
    ({"subscribe": "t", "bogus": "1"}, "unknown option 'bogus'"),
    ({"subscribe": "t", "assign": '{"t": ["1-0"]}'}, "exactly one of the options subscribe"),
    ({}, "exactly one of the options subscribe"),
    ({"assign": "{not json"}, "option assign: not valid JSON"),
    ({"assign": '{"t": ["x"]}'}, "<brokerId>-<n>"),
    ({"subscribe": "t", "startingOffsets": "latest"}, "'latest' is only for streaming"),
    ({"subscribe": "t", "maxOffsetsPerTrigger": "10"}, "maxOffsetsPerTrigger is only for streaming"),
    ({"subscribe": "t", "failOnDataLoss": "maybe"}, "failOnDataLoss: expected true or false"),
    ({"subscribe": "t", "minPartitions": "0"}, "minPartitions: must be at least 1"),
    ({"subscribePattern": "("}, "subscribePattern: not a valid regular expression"),
    ({"subscribe": "t", "startingOffsets": "group"}, "startingOffsets=group needs the option group"),
    ({"assign": '{"t": ["1-7"]}'}, "option assign: topic t has no partition 1-7"),
])
def test_bad_options_fail_at_load_naming_the_option(spark, cluster, options, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace("[", r"\[")):
        reader(spark, cluster, **options).collect()


def test_missing_zookeeper_option_is_named(spark):
    with pytest.raises(Exception, match="metaq.zk.connect is required"):
        spark.read.format("metaq").option("subscribe", "t").load().collect()


def test_streaming_options_are_checked_at_start(spark, cluster, tmp_path):
    df = reader(spark, cluster, streaming=True, subscribe="t", maxTriggerDelay="soon")
    with pytest.raises(Exception, match="maxTriggerDelay"):
        df.writeStream.format("memory").queryName("bad").option("checkpointLocation", str(tmp_path)).start() \
            .awaitTermination(60)


def test_available_now_with_limits_restart_and_group_offsets(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"events": {"numPartitions": 2}})
    fill(cluster, "events", 150, ["1-0", "1-1"])
    checkpoint, out = tmp_path / "ck", tmp_path / "out"
    df = reader(spark, cluster, streaming=True, subscribe="events", maxOffsetsPerTrigger=100, group="g-events")
    assert run_available_now(df, checkpoint, path=out) == [100, 100, 100]
    first = spark.read.parquet(str(out)).select("partition", "offset").collect()
    assert sorted((r.partition, r.offset) for r in first) == [(p, o) for p in ("1-0", "1-1") for o in range(150)]
    # The group's offsets in ZooKeeper never run ahead of Spark's committed batches.
    with cluster.client(Consumer, group="g-events") as consumer:
        committed = consumer.committed("events")
    assert committed and all(0 < o <= 150 for o in committed.values())
    # More data arrives; a restart from the checkpoint reads exactly the new messages.
    fill(cluster, "events", 40, ["1-0", "1-1"])
    df = reader(spark, cluster, streaming=True, subscribe="events", group="g-events")
    assert run_available_now(df, checkpoint, path=out) == [80]
    both = spark.read.parquet(str(out)).select("partition", "offset", "value").collect()
    assert sorted((r.partition, r.offset) for r in both) == [(p, o) for p in ("1-0", "1-1") for o in range(190)]
    assert all(r.value == b"%s:%d" % (r.partition.encode(), r.offset % 150 if r.offset < 150 else r.offset - 150)
               for r in both)


def test_starting_from_the_group_offsets(spark, cluster, tmp_path):
    cluster.start_broker(1, topics={"g": {"numPartitions": 1}})
    fill(cluster, "g", 50, ["1-0"])
    with cluster.client(Consumer, group="takeover") as consumer:
        consumer.commit("g", {"1-0": 30})
    df = reader(spark, cluster, streaming=True, subscribe="g", startingOffsets="group", group="takeover")
    run_available_now(df, tmp_path / "ck", name="g_rows")
    assert sorted(r.offset for r in spark.sql("select offset from g_rows").collect()) == list(range(30, 50))


def test_data_loss_fails_or_continues(spark, cluster, tmp_path):
    cluster.start_broker(1, settings={"retentionCheckInterval": 1},
                         topics={"lossy": {"numPartitions": 1, "maxSegmentSize": 4096, "retentionBytes": 8192}})
    fill(cluster, "lossy", 2000, ["1-0"], batch=20)
    with cluster.client(Admin) as admin:
        wait_until(lambda: admin.describe("lossy")[0].earliest, timeout=30, what="retention")
        seen = []  # retention runs every second and removes one segment at a time: wait until it is done

        def settled():
            seen.append(admin.describe("lossy")[0].earliest)
            return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
        wait_until(settled, timeout=30, interval=1.0, what="retention to finish")
        earliest = seen[-1]
    start = json.dumps({"lossy": {"1-0": 0}})
    with pytest.raises(Exception, match=rf"offsets 0 to {earliest - 1} of lossy 1-0 are gone"):
        reader(spark, cluster, subscribe="lossy", startingOffsets=start).collect()
    rows = reader(spark, cluster, subscribe="lossy", startingOffsets=start, failOnDataLoss="false").collect()
    assert sorted(r.offset for r in rows) == list(range(earliest, 2000))
    df = reader(spark, cluster, streaming=True, subscribe="lossy", startingOffsets=start)
    q = (df.writeStream.format("memory").queryName("lossy_fail").option("checkpointLocation", str(tmp_path / "a"))
         .trigger(availableNow=True).start())
    with pytest.raises(Exception, match="are gone"):
        q.awaitTermination(120)
