"""Spark filter pushdown for batch reads (``metaq_spark/pushdown.py``, ``MetaqFilteringBatchReader``):
which filters the source takes (pure tests of ``push``), and real queries on real brokers, each run with
spark.sql.python.filterPushdown.enabled false (pyspark's default: the plain reader, Spark filters) and
true (topics, partitions and offsets narrow the ranges, keys and ids are looked up): the same rows both
ways and as a scan of the topic finds them; ``explain`` names what was pushed; a topic without a key
index keeps key filters with Spark."""
from __future__ import annotations

import json

import pytest
from pyspark.sql.datasource import EqualTo, GreaterThan, In, IsNotNull, LessThanOrEqual, StringStartsWith

from conftest import wait_until
from metaq_broker.client.producer import Producer
from metaq_spark.pushdown import MAX_LOOKUPS, MAX_OFFSET, Pushed, push
from spark_helpers import reader

PUSHDOWN = "spark.sql.python.filterPushdown.enabled"
TOPICS = {"orders": {"numPartitions": 2, "maxSegmentSize": 8192}, "plain": {"keyIndex": "false"}}


@pytest.mark.unit
def test_push_takes_what_it_answers_exactly_and_hands_back_the_rest():
    key = EqualTo(("key",), b"k1")
    starts = StringStartsWith(("value",), "v")
    pushed, kept = push([key, IsNotNull(("key",)), In(("partition",), ("1-0", "2-0")), GreaterThan(("offset",), 4),
                         LessThanOrEqual(("offset",), 9), starts, EqualTo(("msgId",), 77)], key_index=True)
    assert kept == [starts]
    assert (pushed.keys, pushed.partitions, pushed.offsets, pushed.msg_ids) == \
        (frozenset({b"k1"}), frozenset({"1-0", "2-0"}), (5, 10), frozenset({77}))
    assert len(pushed.shown) == 6 and not pushed.empty

    # Without a key index key filters stay with Spark, and so does IsNotNull(key) (it selects rows then).
    pushed, kept = push([key, IsNotNull(("key",))], key_index=False)
    assert kept == [key, IsNotNull(("key",))] and pushed == Pushed()

    # Keys given as text are their UTF-8 bytes; contradictions select nothing.
    pushed, kept = push([In(("key",), ("a", "b")), EqualTo(("key",), "b")], key_index=True)
    assert kept == [] and pushed.keys == frozenset({b"b"})
    assert push([EqualTo(("key",), "a"), EqualTo(("key",), "b")], key_index=True)[0].empty
    assert push([GreaterThan(("offset",), 5), LessThanOrEqual(("offset",), 5)], key_index=True)[0].empty

    # An offset IN list: its range is read, the list stays with Spark; a value that is not a number stays.
    offsets = In(("offset",), (3, 9))
    pushed, kept = push([offsets, EqualTo(("msgId",), "7"), EqualTo(("key",), None)], key_index=True)
    assert pushed.offsets == (3, 10) and kept == [offsets, EqualTo(("msgId",), "7"), EqualTo(("key",), None)]
    assert push([], key_index=True)[0] == Pushed() and Pushed().offsets == (0, MAX_OFFSET)

    # A list longer than MAX_LOOKUPS costs more lookups than reading: Spark's.
    many = In(("key",), tuple(b"k%d" % i for i in range(MAX_LOOKUPS + 1)))
    assert push([many], key_index=True) == (Pushed(), [many])
    assert push([In(("msgId",), tuple(range(MAX_LOOKUPS)))], key_index=True)[1] == []


@pytest.fixture
def orders(cluster):
    for b in (1, 2):
        cluster.start_broker(b, topics=TOPICS)
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 4, what="topic on both brokers")
        for topic in ("orders", "plain"):
            for i in range(40):
                producer.send_batch(topic, [b"v%d-%d" % (i, j) for j in range(25)],
                                    keys=[b"order-%d" % ((i * 25 + j) % 13) if j % 7 else None for j in range(25)])
        for _ in range(6):  # more answers in one partition than a Lookup gives at once (MAX_ANSWERS)
            producer.send_batch("orders", [b"x"] * 2000, keys=[b"order-3"] * 2000, partition="1-0")
    return cluster


QUERIES = [  # (where, what explain names as pushed with pushdown on; None: nothing)
    ("key = X'6F726465722D33'", "EqualTo(key,"),  # order-3: more than MAX_ANSWERS in 1-0
    ("key = cast('order-7' as binary)", "EqualTo(key,"),
    ("key IN (cast('order-1' as binary), cast('order-12' as binary), cast('none' as binary))", "In(key,"),
    ("key = cast('order-5' as binary) AND value LIKE 'v1%'", "EqualTo(key,"),
    ("key = cast('order-2' as binary) AND partition = '2-1' AND offset > 100",
     "EqualTo(partition,2-1), GreaterThan(offset,100)"),
    ("partition = '1-0' AND offset >= 10 AND offset < 30", "GreaterThanOrEqual(offset,10), LessThan(offset,30)"),
    ("msgId = {msg_id}", "EqualTo(msgId,{msg_id})"),
    ("msgId IN ({msg_id}, 5)", "In(msgId,"),
    ("topic = 'orders' AND offset = 12000", "EqualTo(offset,12000)"),
    ("offset IN (3, 7, 400)", None),  # narrows the ranges to [3, 401), and stays with Spark
    ("substring(key, 1, 7) = cast('order-9' as binary)", None),  # Spark cannot push this
    ("value = cast('v3-4' as binary)", None),  # nor a filter on values
]


def rows(df):
    return sorted((r.topic, r.partition, r.offset, r.key, r.value) for r in df.collect())


def explained(df, capsys) -> str:
    capsys.readouterr()
    df.explain("formatted")
    return capsys.readouterr().out


@pytest.mark.parametrize("subscribe", ["orders", "plain"])
def test_pushed_filters_give_the_rows_spark_finds_and_explain_names_them(orders, spark, capsys, subscribe):
    msg_id = reader(spark, orders, subscribe=subscribe).where("partition = '2-0' AND offset = 17").collect()[0].msgId
    try:
        for where, shown in QUERIES:
            where = where.format(msg_id=msg_id)
            spark.conf.set(PUSHDOWN, "false")  # pyspark's default: the plain reader, every filter Spark's
            df = reader(spark, orders, subscribe=subscribe).where(where)
            plain = rows(df)
            assert "PushedFilters" not in explained(df, capsys)
            spark.conf.set(PUSHDOWN, "true")
            df = reader(spark, orders, subscribe=subscribe).where(where)
            assert rows(df) == plain, where
            plan = explained(df, capsys)
            if subscribe == "plain" and shown and "key" in shown:  # no key index: key filters stay Spark's
                assert "(key," not in plan.split("PushedFilters")[-1].split("\n")[0], plan
            elif shown:
                assert "PushedFilters: [" in plan and shown.format(msg_id=msg_id) in plan, (where, plan)
            else:
                assert "PushedFilters" not in plan, plan
            if "key = cast('order-7'" in where:
                assert plain and {r[3] for r in plain} == {b"order-7"}  # a query that finds something
        # A range given by options: lookups answer only within it (and page through it).
        bounds = {"startingOffsets": json.dumps({subscribe: {"1-0": 300, "2-1": 3}}),
                  "endingOffsets": json.dumps({subscribe: {"1-0": 600, "2-1": 100, "1-1": 50, "2-0": 1}})}
        got = {}
        for setting in ("false", "true"):
            spark.conf.set(PUSHDOWN, setting)
            got[setting] = rows(reader(spark, orders, subscribe=subscribe, **bounds).where(
                "key IN (cast('order-3' as binary), cast('order-4' as binary))"))
        assert got["true"] == got["false"] and "1-0" in {r[1] for r in got["true"]}
        limits = {"1-0": (300, 600), "2-1": (3, 100), "1-1": (0, 50), "2-0": (0, 1)}
        assert all(limits[r[1]][0] <= r[2] < limits[r[1]][1] for r in got["true"])
        # A range past the partition's end (a broker that lost messages): the same error both ways.
        for setting in ("false", "true"):
            spark.conf.set(PUSHDOWN, setting)
            with pytest.raises(Exception, match="2-0 went backwards"):
                reader(spark, orders, subscribe=subscribe, endingOffsets=json.dumps({subscribe: {"2-0": 100_000}})) \
                    .where("key = cast('order-4' as binary)").collect()
        spark.conf.set(PUSHDOWN, "true")
        assert rows(reader(spark, orders, subscribe=subscribe)) == \
            rows(reader(spark, orders, subscribe=subscribe).where("key IS NULL OR key IS NOT NULL"))
    finally:
        spark.conf.unset(PUSHDOWN)
