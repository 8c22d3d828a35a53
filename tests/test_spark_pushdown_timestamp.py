"""``timestamp`` filters narrow a batch read's offset ranges (``pushdown.push``'s ``create_times``, the
brokers' ``offsets_for_create_times``) and stay with Spark: the same rows as a read without pushdown and as
a full scan filtered here, fewer offsets planned, also when producers' clocks are decades off (create times
far in the past and the future: the adversary's messages, which widen their segments' bounds)."""
from __future__ import annotations

import datetime
import time

import pytest
from pyspark.sql.datasource import EqualTo, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual

from conftest import wait_until
from metaq_broker.client.producer import Producer
from metaq_spark.options import parse
from metaq_spark.pushdown import Pushed, push
from metaq_spark.reader import MetaqFilteringBatchReader
from spark_helpers import reader

PUSHDOWN = "spark.sql.python.filterPushdown.enabled"
UTC = datetime.timezone.utc
PAST = int(datetime.datetime(2001, 2, 3, tzinfo=UTC).timestamp() * 1000)  # a producer's clock 25 years behind
FUTURE = int(datetime.datetime(2099, 1, 1, tzinfo=UTC).timestamp() * 1000)  # and one 70 years ahead


def at(ms: int, us: int = 0) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, UTC) + datetime.timedelta(microseconds=us)


@pytest.mark.unit
def test_timestamp_filters_narrow_in_whole_ms_and_stay_with_spark():
    t = 1_700_000_000_123
    filters = [GreaterThanOrEqual(("timestamp",), at(t, 500)), LessThan(("timestamp",), at(t + 10, 1))]
    pushed, kept = push(filters, key_index=True)
    assert kept == filters  # Spark filters the rows; the ranges only shrink
    assert pushed.create_times == (t + 1, t + 10) and pushed.narrowing and not pushed.shown
    assert push([GreaterThan(("timestamp",), at(t))], True)[0].create_times == (t + 1, None)
    assert push([GreaterThan(("timestamp",), at(t, 999))], True)[0].create_times == (t + 1, None)
    assert push([LessThanOrEqual(("timestamp",), at(t, 999))], True)[0].create_times == (None, t)
    assert push([LessThan(("timestamp",), at(t))], True)[0].create_times == (None, t - 1)
    assert push([EqualTo(("timestamp",), at(t))], True)[0].create_times == (t, t)
    assert push([EqualTo(("timestamp",), at(t, 5))], True)[0].empty  # no whole ms equals it
    assert push([GreaterThan(("timestamp",), at(t)), LessThan(("timestamp",), at(t))], True)[0].empty
    naive = GreaterThan(("timestamp",), datetime.datetime(2024, 1, 1))  # zone unknown: not narrowed
    assert push([naive], True) == (Pushed(), [naive])
    # Before the epoch (µs rounding toward -inf).
    assert push([GreaterThanOrEqual(("timestamp",), at(-5, -1))], True)[0].create_times == (-5, None)


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def clocks(cluster):
    """Topic ``clocks`` (2 partitions, small segments): batches whose create times are the producer's clock,
    the broker's clock moving on between them, some without create times; in 1-1 a few from clocks decades
    off, in its first half. Returns (cluster, the create time of the batch two thirds in)."""
    cluster.start_broker(1, topics={"clocks": {"numPartitions": 2, "maxSegmentSize": 8192}})
    marks = []
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions("clocks")) == 2, what="topic")
        for i in range(90):
            last = now_ms()
            wait_until(lambda: now_ms() > last + 15, interval=0.005, what="the clock to move on")
            stamp = now_ms()
            sane = None if i % 4 == 0 else [stamp] * 5
            wild = [PAST + i] * 5 if i in (20, 45) else [FUTURE + i] * 5 if i in (25, 40) else sane
            for p, stamps in (("1-0", sane), ("1-1", wild)):  # ~1 KiB a batch: a segment holds about seven
                producer.send_batch("clocks", [b"v%d-%d-" % (i, j) + b"x" * 200 for j in range(5)], partition=p,
                                    timestamps=stamps)
            marks.append(stamp)
    return cluster, marks[61]


def rows(df):
    return sorted((r.partition, r.offset, r.timestamp, r.value) for r in df.collect())


def planned(cluster, *filters) -> dict:
    """{partition: (start, end)} a filtering reader plans for ``filters`` (the driver's side, in this process)."""
    r = MetaqFilteringBatchReader(parse({"metaq.zk.connect": cluster.zk_connect, "metaq.zk.root": cluster.zk_root,
                                         "subscribe": "clocks"}, False))
    try:
        assert r.pushFilters(list(filters)) == list(filters)
        return {p.partition: (p.start, p.end) for p in r.partitions() if p.value is not None}
    finally:
        r.planner.close()


def test_timestamp_filters_read_fewer_offsets_and_give_exactly_spark_rows(clocks, spark):
    cluster, x = clocks
    everything = rows(reader(spark, cluster, subscribe="clocks"))
    total = len(everything)
    assert total == 2 * 90 * 5
    queries = [  # (where, its filters, the share of 1-0's offsets its range may hold at most)
        (f"timestamp >= timestamp_millis({x})", [GreaterThanOrEqual(("timestamp",), at(x))], 0.4),
        (f"timestamp > timestamp_millis({x}) AND timestamp <= timestamp_millis({x + 200})",
         [GreaterThan(("timestamp",), at(x)), LessThanOrEqual(("timestamp",), at(x + 200))], 0.2),
        (f"timestamp = timestamp_millis({x})", [EqualTo(("timestamp",), at(x))], 0.2),
        # The adversary's times (in 1-1 only): its segments' bounds are decades wide, so they are read.
        (f"timestamp < timestamp_millis({PAST + 1000})", [LessThan(("timestamp",), at(PAST + 1000))], 0),
        (f"timestamp > timestamp_millis({FUTURE})", [GreaterThan(("timestamp",), at(FUTURE))], 0),
    ]
    try:
        for where, filters, share in queries:
            wanted = [r for r in everything if eval_filter(r[2], filters)]
            spark.conf.set(PUSHDOWN, "false")
            plain = rows(reader(spark, cluster, subscribe="clocks").where(where))
            spark.conf.set(PUSHDOWN, "true")
            pushed = rows(reader(spark, cluster, subscribe="clocks").where(where))
            assert pushed == plain == wanted and wanted, where
            ranges = planned(cluster, *filters)
            assert all(ranges[r[0]][0] <= r[1] < ranges[r[0]][1] for r in wanted), (where, ranges)
            sane = ranges.get("1-0", (0, 0))
            assert sane[1] - sane[0] <= share * total / 2, (where, ranges)
            if share:  # with wild clocks 1-1 is read from (at the latest) its first wild batch's segment
                assert ranges["1-1"][1] - ranges["1-1"][0] < total / 2, (where, ranges)
    finally:
        spark.conf.unset(PUSHDOWN)


def eval_filter(ts: datetime.datetime, filters) -> bool:
    """A row's ``timestamp`` against pyspark filter objects, as Spark compares them (µs)."""
    ops = {GreaterThanOrEqual: lambda a, b: a >= b, GreaterThan: lambda a, b: a > b, LessThan: lambda a, b: a < b,
           LessThanOrEqual: lambda a, b: a <= b, EqualTo: lambda a, b: a == b}
    ts = ts if ts.tzinfo else ts.astimezone(UTC)
    return all(ops[type(f)](ts, f.value) for f in filters)
