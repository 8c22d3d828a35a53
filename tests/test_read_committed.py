"""Readers see committed messages only (issue 13), through every read path and real brokers: transactions
write into the partition log, fetches stop at the last stable offset (LSO) and leave out aborted
transactions and markers, whose offsets are gaps. The Consumer, ``metaq consume``/``offsets``, a batch and
a streaming Spark read, each over the data port and over FetchRaw (``dataPort=-1``)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import wait_until
import cli
from spark_helpers import reader, run_available_now
from test_metrics import Scrape

from metaq_broker.client.connection import BrokerConnection
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.dataconn import DataConnection
from metaq_broker.client.producer import Producer
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawfetch, records
from metaq_broker.protocol.status import RemoteOffsetOutOfRangeError

pytestmark = pytest.mark.unit

TOPIC = "tx"
BIG = 700  # messages of 1000 bytes in each batch of 1-1's aborted transaction: one batch fills a 1 MiB fetch

# 1-0 as the fixture writes it: offset -> value of every committed message while transaction c is open.
# 4-6 are b's (rolled back), 9 and 10 the markers of a and b, 12 is c's (open), 13 a plain message
# past the LSO (12); the log end is 14.
COMMITTED = {0: b"p0", 1: b"p1", 2: b"a0", 3: b"a1", 7: b"p2", 8: b"a2", 11: b"p3"}
AFTER_C = {**COMMITTED, 12: b"c0", 13: b"p4"}  # once c commits (its marker at 14; the log end 15)
# 1-1: offsets 0..1399 a rolled-back transaction, its marker at 1400, then one plain message
COMMITTED_1 = {2 * BIG + 1: b"after"}


@pytest.fixture(params=[0, -1], ids=["dataport", "fetchraw"])
def txlog(request, cluster):
    """A broker (data port on, or off: FetchRaw) holding committed, rolled-back and open transactions."""
    broker = cluster.start_broker(1, settings={"dataPort": request.param, "metricsPort": 0,
                                      "transactionTimeout": 600_000},
                         topics={TOPIC: {"numPartitions": 2}})
    with cluster.client(Producer) as p:
        wait_until(lambda: len(p.cluster.topic_partitions(TOPIC)) == 2, what="topic")

        def put(values, partition="1-0"):
            p.send_batch(TOPIC, values, partition=partition)

        put([b"p0", b"p1"])  # 0, 1
        a = p.transaction("a")
        a.send_batch(TOPIC, [b"a0", b"a1"], partition="1-0")  # 2, 3
        b = p.transaction("b")
        b.send_batch(TOPIC, [b"b0", b"b1", b"b2"], partition="1-0")  # 4-6
        put([b"p2"])  # 7
        a.send_batch(TOPIC, [b"a2"], partition="1-0")  # 8
        a.prepare()
        a.commit()  # marker 9
        b.rollback()  # marker 10
        put([b"p3"])  # 11
        c = p.transaction("c", timeout_ms=600_000)
        c.send_batch(TOPIC, [b"c0"], partition="1-0")  # 12: open, holds the LSO at 12
        put([b"p4"])  # 13

        big = p.transaction("big")
        for _ in range(2):
            big.send_batch(TOPIC, [b"x" * 1000] * BIG, partition="1-1")
        big.prepare()
        big.rollback()
        put([b"after"], "1-1")

        def commit_c():
            c.prepare()
            c.commit()

        yield SimpleNamespace(cluster=cluster, broker=cluster.brokers[1], data_port=request.param != -1,
                              metrics=broker.metrics_port, commit_c=commit_c)


def committed_rows(table):
    return dict(zip(table.column("offset").to_pylist(), table.column("value").to_pylist()))


metaq = cli.metaq_on


def test_the_consumer_sees_committed_messages_with_gaps_and_stops_at_the_lso(txlog):
    with txlog.cluster.client(Consumer) as c:
        assert c.offsets(TOPIC) == {"1-0": (0, 12), "1-1": (0, 2 * BIG + 2)}
        assert c.offset_bounds(TOPIC) == {"1-0": (0, 12, 14), "1-1": (0, 2 * BIG + 2, 2 * BIG + 2)}
        assert committed_rows(c.read_range(TOPIC, "1-0", 0, 12)) == COMMITTED
        assert committed_rows(c.read_range(TOPIC, "1-1", 0, 2 * BIG + 2)) == COMMITTED_1

        # Positioned inside the aborted range: its batch is left out, the reply goes on past it.
        f = c.fetch(TOPIC, "1-0", 5)
        assert (f.start_offset, f.next_offset, f.latest) == (5, 12, 12)
        assert f.batch.column("offset").to_pylist() == [7, 8, 11]
        # A reply of aborted messages only decodes to nothing, yet moves on.
        f = c.fetch(TOPIC, "1-0", 4, max_messages=3)
        assert (f.batch.num_rows, f.next_offset) == (0, 7)
        f = c.fetch(TOPIC, "1-0", 9, max_messages=2)  # the two markers
        assert (f.batch.num_rows, f.next_offset) == (0, 11)
        f = c.fetch(TOPIC, "1-1", 0)  # one aborted batch fills the fetch
        assert (f.batch.num_rows, f.next_offset) == (0, BIG)

        # At the LSO and between it and the log end: nothing (no error) until c settles.
        for offset in (12, 13, 14):
            f = c.fetch(TOPIC, "1-0", offset)
            assert (f.batch.num_rows, f.next_offset, f.latest) == (0, offset, 12)
        with pytest.raises(RemoteOffsetOutOfRangeError):
            c.fetch(TOPIC, "1-0", 15)

    # A group member starting at the latest offsets (the LSO) sees c's messages once c commits.
    with txlog.cluster.client(Consumer, group="g") as c:
        assert c.subscribe(TOPIC, start="latest") == ["1-0", "1-1"]
        assert c.poll(TOPIC) == [] and c.positions[(TOPIC, "1-0")] == 12
        txlog.commit_c()
        assert c.offset_bounds(TOPIC, ["1-0"]) == {"1-0": (0, 15, 15)}
        assert [committed_rows(f.batch) for f in c.poll(TOPIC)] == [{12: b"c0", 13: b"p4"}]
        assert c.positions[(TOPIC, "1-0")] == 15
        assert committed_rows(c.read_range(TOPIC, "1-0", 0, 15)) == AFTER_C


def test_every_fetch_path_sends_the_same_aborted_list(txlog):
    with txlog.cluster.client(Consumer) as c:
        address = c.cluster.brokers()[1]
        data_address = c.data_address(1)
    assert (data_address is not None) == txlog.data_port
    g = BrokerConnection(address, timeout=10)
    request = dict(topic=TOPIC, partition=0, offset=0)
    raw = g.call("FetchRaw", pb.FetchRequest(**request))
    fetch = g.call("Fetch", pb.FetchRequest(**request))
    assert (raw.start_offset, raw.end_offset, raw.latest_offset) == (0, 12, 12)
    [(txn, first, last)] = raw.aborted.tolist()
    assert (first, last) == (4, 10)  # b's batch, up to its abort marker
    assert np.frombuffer(fetch.aborted, records.ABORTED_DTYPE).tolist() == raw.aborted.tolist()
    assert (fetch.end_offset, fetch.latest_offset, fetch.records) == (12, 12, bytes(raw.records))
    header = records.parse_header(bytes(raw.records), int(fetch.batch_positions[2]))
    assert (header.base_offset, header.txn) == (4, txn) and header.attributes & records.TRANSACTIONAL
    assert committed_rows(records.decode(raw.records, 0, 12, aborted=raw.aborted)) == COMMITTED
    # Without the list the aborted batch would be read: the list is what leaves it out.
    assert 5 in records.decode(raw.records, 0, 12).column("offset").to_pylist()
    # Past the aborted range no entry is sent.
    assert len(g.call("FetchRaw", pb.FetchRequest(topic=TOPIC, partition=0, offset=11)).aborted) == 0
    if txlog.data_port:
        with DataConnection(data_address, timeout=10) as d:
            for offset, max_messages in ((0, 0), (5, 0), (4, 3), (11, 0), (12, 0), (13, 0)):
                a = d.fetch(TOPIC, 0, offset, max_messages=max_messages)
                b = g.call("FetchRaw", pb.FetchRequest(topic=TOPIC, partition=0, offset=offset,
                                                       max_messages=max_messages))
                assert (a.start_offset, a.end_offset, a.latest_offset, bytes(a.records), a.aborted.tolist()) == \
                       (b.start_offset, b.end_offset, b.latest_offset, bytes(b.records), b.aborted.tolist())
            big = d.fetch(TOPIC, 1, 0)
            assert big.aborted.tolist() and big.aborted["first"].tolist() == [0]
            assert records.decode(big.records, big.start_offset, big.end_offset, aborted=big.aborted).num_rows == 0
    g.close()


def test_the_wire_layout_of_the_aborted_list():
    entries = np.array([(7, 4, 10), (9, 11, 30)], records.ABORTED_DTYPE)
    packed = rawfetch.pack(3, 12, 0, 12, b"\x00" * 16, entries)
    assert rawfetch.HEADER.unpack_from(packed)[0] == 40 + 8 + 2 * 24  # header_len: where the records start
    assert packed[40:48] == (2).to_bytes(4, "little") + bytes(4)
    reply = rawfetch.unpack(packed)
    assert reply.aborted.tolist() == [(7, 4, 10), (9, 11, 30)] and bytes(reply.records) == b"\x00" * 16
    old = rawfetch.HEADER.pack(40, 0, 3, 12, 0, 12) + b"\x00" * 16  # a broker that sends no list
    assert len(rawfetch.unpack(old).aborted) == 0 and len(rawfetch.unpack(old).records) == 16
    with pytest.raises(ValueError, match="cannot hold 5 aborted"):
        rawfetch.unpack(rawfetch.HEADER.pack(48, 0, 3, 12, 0, 12) + rawfetch.ABORTED.pack(5, 0))


def test_metaq_consume_and_offsets(txlog):
    r = metaq(txlog.cluster, "offsets", TOPIC)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [b"tx\t1-0\t0\t12\t14", b"tx\t1-1\t0\t%d\t%d" % (2 * BIG + 2, 2 * BIG + 2)]
    r = metaq(txlog.cluster, "consume", TOPIC, "--partition", "1-0", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert {x["offset"]: x["value"].encode() for x in map(json.loads, r.stdout.splitlines())} == COMMITTED
    # 1-1 starts with fetches that decode to nothing (one aborted batch fills each): consume reads on.
    r = metaq(txlog.cluster, "consume", TOPIC, "--partition", "1-1")
    assert r.returncode == 0 and r.stdout == b"after\n", r.stderr
    r = metaq(txlog.cluster, "consume", TOPIC, "--partition", "1-0", "--from", "5")
    assert r.stdout.splitlines() == [b"p2", b"a2", b"p3"]


def test_metrics_give_the_last_stable_offset_beside_the_log_end(txlog):
    m = Scrape(txlog.metrics)
    one = {"topic": TOPIC, "partition": "1-0"}
    assert (m("metaq_last_stable_offset", **one), m("metaq_latest_offset", **one)) == (12, 14)
    txlog.commit_c()
    m = Scrape(txlog.metrics)
    assert (m("metaq_last_stable_offset", **one), m("metaq_latest_offset", **one)) == (15, 15)


def spark_rows(df):
    return sorted((r.partition, r.offset, r.value) for r in df.select("partition", "offset", "value").collect())


def expected(*layouts):
    return sorted((p, o, v) for p, rows in layouts for o, v in rows.items())


def test_spark_batch_reads_committed_messages_up_to_the_lso(spark, txlog):
    cluster = txlog.cluster
    want = expected(("1-0", COMMITTED), ("1-1", COMMITTED_1))
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC)) == want
    # Ranges split by offsets (some pieces fall wholly in gaps), small fetches: the same rows.
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC, minPartitions="9", fetchMaxBytes="4096")) == want
    # An explicit range inside the aborted one reads nothing, and is no data loss.
    ranges = {"startingOffsets": json.dumps({TOPIC: {"1-0": 4, "1-1": 5}}),
              "endingOffsets": json.dumps({TOPIC: {"1-0": 7, "1-1": 2 * BIG}})}
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC, **ranges)) == []
    # A range into the open transaction waits for it (fetchTimeoutMs), then fails: nothing is lost,
    # so failOnDataLoss=false does not skip it either.
    into = json.dumps({TOPIC: {"1-0": 14, "1-1": -1}})
    for lenient in ("true", "false"):
        with pytest.raises(Exception, match=r"tx 1-0: the batch needs offsets 12 to 13, but a transaction still "
                                            r"open after fetchTimeoutMs=1000"):
            reader(spark, cluster, subscribe=TOPIC, endingOffsets=into, fetchTimeoutMs="1000",
                   failOnDataLoss=lenient).collect()
    # Starting inside the open transaction (past the LSO, within the log end) is no data loss either:
    # nothing to read until it settles, then from there on.
    inside = {"startingOffsets": json.dumps({TOPIC: {"1-0": 13, "1-1": 2 * BIG + 2}})}
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC, **inside)) == []
    txlog.commit_c()
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC, **inside)) == [("1-0", 13, b"p4")]
    assert spark_rows(reader(spark, cluster, subscribe=TOPIC)) == expected(("1-0", AFTER_C), ("1-1", COMMITTED_1))


def test_spark_stream_waits_at_the_lso_without_data_loss(spark, txlog, tmp_path):
    def stream():
        return reader(spark, txlog.cluster, streaming=True, subscribe=TOPIC, maxOffsetsPerTrigger="500",
                      startingOffsets="earliest")

    out = tmp_path / "out"
    run_available_now(stream(), tmp_path / "cp", path=out)
    got = spark.read.parquet(str(out))
    assert spark_rows(got) == expected(("1-0", COMMITTED), ("1-1", COMMITTED_1))
    txlog.commit_c()
    run_available_now(stream(), tmp_path / "cp", path=out)
    assert spark_rows(spark.read.parquet(str(out))) == expected(("1-0", AFTER_C), ("1-1", COMMITTED_1))
