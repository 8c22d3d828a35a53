"""The broker's data port (bulk fetches over TCP with sendfile): the same answers as FetchRaw, errors
included; persistent pooled connections; restarts; registration in ZooKeeper; the Spark source over it,
and over FetchRaw when it is off or unreachable."""
import json
import os
import socket
import struct
import threading
import time

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from test_metrics import Scrape, port_is_free

from metaq_broker.client.connection import BrokerConnection
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.dataconn import DataConnection, DataConnectionPool
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.process import freeze
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import dataport, rawput, records
from metaq_broker.protocol.status import BrokerError
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(tmp_path, name="b", **settings):
    overrides = {"brokerId": 1, "serverPort": 0, "kafkaPort": 0, "zk.connect": "none", "dataPath": tmp_path / name,
                 "maxFetchWait": 5000, **settings}
    broker = Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()
    broker.create_topic("t", None, {})  # a no-op when it is there from an earlier run
    return broker


def fill(broker, topic="t", batches=5, per_batch=100, partition="1-0"):
    with Producer(brokers={1: broker.address}) as producer:
        for i in range(batches):
            producer.send_batch(topic, [b"m%d-%d" % (i, j) for j in range(per_batch)], partition=partition)


def both(grpc_conn, data_conn, **request):
    """(outcome over FetchRaw, outcome over the data port): the reply's fields, or the error's type,
    status code and broker message."""
    def outcome(call):
        try:
            r = call()
        except BrokerError as e:
            return type(e), e.code, e.details
        return r.start_offset, r.end_offset, r.earliest_offset, r.latest_offset, bytes(r.records)
    raw = outcome(lambda: grpc_conn.call("FetchRaw", pb.FetchRequest(**request)))
    data = outcome(lambda: data_conn.fetch(**request))
    return raw, data


def test_data_port_answers_exactly_what_fetch_raw_answers(tmp_path):
    b = start_broker(tmp_path)
    try:
        fill(b)
        g, d = BrokerConnection(b.address, timeout=10), DataConnection(f"127.0.0.1:{b.data_port}", timeout=10)
        cases = [dict(offset=0), dict(offset=0, max_bytes=1 << 20), dict(offset=150, max_bytes=1024),
                 dict(offset=250, max_messages=120), dict(offset=499, max_messages=1), dict(offset=500),
                 dict(offset=501), dict(offset=-3), dict(offset=0, max_bytes=-1), dict(offset=0, max_messages=-1),
                 dict(offset=0, partition=5), dict(offset=0, topic="nope"), dict(offset=0, topic="bad name!")]
        for case in cases:
            request = {"topic": "t", "partition": 0, **case}
            raw, data = both(g, d, **request)
            assert raw == data, request
        assert d.connects == 1  # errors leave the connection usable
        raw, data = both(g, d, topic="t", partition=0, offset=0)
        assert len(raw[4]) > 0 and records.decode(data[4], data[0], data[1]).num_rows == 500

        # an operator-closed partition, then reopened
        g.call("ClosePartitions", pb.PartitionRangeRequest(topic="t", start=0, end=0))
        raw, data = both(g, d, topic="t", partition=0, offset=0)
        assert raw == data and "closed" in data[2] and data[1].name == "FAILED_PRECONDITION"
        g.call("OpenPartitions", pb.TopicRequest(topic="t"))
        assert both(g, d, topic="t", partition=0, offset=0)[1][1] == 500

        # a long poll at the log end answers when data comes
        later = threading.Timer(0.3, fill, (b,), {"batches": 1})
        later.start()
        t0 = time.monotonic()
        r = d.fetch("t", 0, 500, max_wait_ms=4000)
        later.join()
        assert r.end_offset == 600 and time.monotonic() - t0 < 4

        # a segment file cut short under the broker: DATA_LOSS with the same message
        seg = b.store.partition("t", 0).segments()[-1].path
        os.truncate(seg, seg.stat().st_size - 100)
        raw, data = both(g, d, topic="t", partition=0, offset=500)
        assert raw == data and data[1].name == "DATA_LOSS" and "bytes short" in data[2]
        assert d.connects == 1

        # counters: every data port fetch counted like a gRPC one
        stats = b.stats.snapshot("t")
        assert sum(p.gets for p in stats) > 0 and sum(p.get_failures for p in stats) > 0
        d.close()
        g.close()
    finally:
        b.stop(grace=1)


def test_connections_are_persistent_pooled_and_pipelined(tmp_path):
    b = start_broker(tmp_path)
    try:
        fill(b, batches=20, per_batch=10)
        address = f"127.0.0.1:{b.data_port}"
        pool = DataConnectionPool(timeout=10)
        conn = pool.acquire(address)
        for offset in range(0, 200, 10):  # pipelined: all sent before any reply is read
            conn.send("t", 0, offset, max_messages=10)
        assert conn.outstanding == 20
        assert [conn.receive().start_offset for _ in range(20)] == list(range(0, 200, 10))
        pool.release(conn)
        again = pool.acquire(address)
        assert again is conn and conn.connects == 1
        assert again.fetch("t", 0, 0).end_offset == 200
        assert b.data_server.listener.connections() == 1
        again.send("t", 0, 0)  # a reply left pending: not given to the next caller
        pool.release(again)
        assert again.sock is None and pool.acquire(address) is not again
        pool.close()
    finally:
        b.stop(grace=1)


def test_broker_restart_on_the_same_port_is_reconnected_and_stop_frees_the_port(tmp_path):
    port = free_port()
    b = start_broker(tmp_path, dataPort=port)
    fill(b)
    pool = DataConnectionPool(timeout=10)
    conn = pool.acquire(f"127.0.0.1:{port}")
    before = conn.fetch("t", 0, 0)
    pool.release(conn)
    b.stop(grace=1)
    assert port_is_free(port)
    b = start_broker(tmp_path, dataPort=port)
    try:
        stale = pool.acquire(f"127.0.0.1:{port}")
        assert stale is not conn  # the idle connection was seen to be closed and dropped
        assert conn.sock is None
        after = stale.fetch("t", 0, 0)
        assert (after.start_offset, after.end_offset, bytes(after.records)) == \
            (before.start_offset, before.end_offset, bytes(before.records))
        # a connection held across the restart reconnects once by itself
        held = DataConnection(f"127.0.0.1:{port}", timeout=10)
        held.fetch("t", 0, 0)
        b.stop(grace=1)
        b = start_broker(tmp_path, dataPort=port)
        assert held.fetch("t", 0, 100).start_offset == 100 and held.connects == 2
        held.close()
    finally:
        b.stop(grace=1)
        pool.close()


def test_a_malformed_request_is_refused_and_the_broker_serves_on(tmp_path):
    b = start_broker(tmp_path)
    try:
        fill(b, batches=1)
        with socket.create_connection(("127.0.0.1", b.data_port), timeout=10) as s:
            s.sendall(struct.pack("<IHHiqiii", 999, 7, 1, 0, 0, 0, 0, 0) + b"t")
            head = s.recv(dataport.REPLY.size, socket.MSG_WAITALL)
            _, status, *_, n = dataport.REPLY.unpack(head)
            assert status == 3 and b"malformed" in s.recv(n, socket.MSG_WAITALL)  # INVALID_ARGUMENT
            try:  # and the connection closed (reset: the broker left the topic byte unread)
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        with socket.create_connection(("127.0.0.1", b.data_port), timeout=10) as s:
            s.sendall(dataport.pack_request("t", 0, 0)[:20])  # half a request, then gone
        with DataConnection(f"127.0.0.1:{b.data_port}") as d:
            assert d.fetch("t", 0, 0).end_offset == 100
    finally:
        b.stop(grace=1)


def test_off_with_minus_one(tmp_path):
    b = start_broker(tmp_path, dataPort=-1)
    try:
        assert b.data_port is None and b.data_server is None
    finally:
        b.stop(grace=1)


def test_a_static_broker_list_learns_the_data_port_from_the_broker(tmp_path):
    """Without ZooKeeper a producer asks each broker of its list for its data port (``DescribeGroup``) and
    puts there; a broker without a data port, or one that cannot be asked, is put to with PutRaw."""
    b = start_broker(tmp_path, metricsPort=0)
    off = start_broker(tmp_path, "off", brokerId=2, dataPort=-1, metricsPort=0)
    try:
        with Producer(brokers=b.address) as producer, Producer(brokers={2: off.address}) as plain:
            assert producer.data_address(1) == f"127.0.0.1:{b.data_port}"
            puts, data_puts = served(b, "Put"), served(b, "PutData")
            r = producer.send_batch("t", [b"a", b"b"], partition="1-0")
            assert (r[0].count, r[0].fsynced) == (2, True)
            assert (served(b, "PutData"), served(b, "Put")) == (data_puts + 1, puts)

            assert plain.data_address(2) is None
            puts = served(off, "Put")
            plain.send_batch("t", [b"c"], partition="2-0")
            assert served(off, "Put") == puts + 1
        address = b.address
        b.stop(grace=1)
        with Producer(brokers={1: address}, timeout=30) as late:
            t0 = time.monotonic()
            assert late.data_address(1) is None  # down: asked without waiting for it
            assert time.monotonic() - t0 < 10  # not the client timeout
    finally:
        b.stop(grace=1)
        off.stop(grace=1)


# -- ZooKeeper and the Spark source ------------------------------------------------------------------

def zk_broker(tmp_path, zookeeper, zk_root, name, **settings):
    return start_broker(tmp_path, name, **{"zk.connect": zookeeper.connect_string, "zk.root": zk_root,
                                           "metricsPort": 0, **settings})


def served(broker, method):
    """Calls of ``method`` the broker's metrics have timed (FetchData: data port fetches)."""
    return Scrape(broker.metrics_port).samples.get(("metaq_rpc_latency_seconds_count", (("method", method),)), 0)


def registration(zookeeper, zk_root):
    zk = KazooClient(zookeeper.connect_string)
    zk.start()
    try:
        return json.loads(zk.get(ZkPaths(zk_root).broker(1))[0])
    finally:
        zk.stop()


def test_registered_in_zookeeper_and_read_partition_uses_it(tmp_path, zookeeper, zk_root):
    from metaq_spark import reader as src
    b = zk_broker(tmp_path, zookeeper, zk_root, "zk")
    try:
        fill(b, batches=30, per_batch=100)
        assert registration(zookeeper, zk_root)["dataPort"] == b.data_port
        with Consumer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as consumer:
            wait_until(lambda: consumer.data_address(1), what="data port in the cluster view")
            assert consumer.data_address(1) == f"127.0.0.1:{b.data_port}"
            assert consumer.data_address(2) is None

        def read(data_address):
            part = src.MetaqPartition("t", "1-0", b.address, 5, 2995, 4096, True, 10_000, data_address)
            return [bt for bt in src.read_partition(part)]
        raw0 = served(b, "FetchRaw")
        via_raw = read(None)
        raw1, data1 = served(b, "FetchRaw"), served(b, "FetchData")
        via_data = read(f"127.0.0.1:{b.data_port}")
        assert served(b, "FetchRaw") == raw1 > raw0
        assert served(b, "FetchData") >= data1 + len(via_data)
        assert [x.to_pydict() for x in via_data] == [x.to_pydict() for x in via_raw]
        assert sum(x.num_rows for x in via_data) == 2990
        conn = src._data_pool().acquire(f"127.0.0.1:{b.data_port}")  # the task gave its connection back
        assert conn.connects == 1
        src._data_pool().release(conn)

        # a data port that cannot be reached (a broker restarted elsewhere): FetchRaw carries the task
        unreachable = read(f"127.0.0.1:{free_port()}")
        assert [x.to_pydict() for x in unreachable] == [x.to_pydict() for x in via_raw]
        # a range past the log end (the broker lost messages) is data loss naming both offsets, as over gRPC
        part = src.MetaqPartition("t", "1-0", b.address, 5000, 5001, 4096, True, 10_000, f"127.0.0.1:{b.data_port}")
        with pytest.raises(src.DataLossError, match=r"t 1-0 went backwards: the batch needs offsets 5000 to 5000 "
                                                    r"but the partition's latest offset is 3000"):
            list(src.read_partition(part))
        # other refusals name the partition, offset and broker as over gRPC
        part = src.MetaqPartition("nope", "1-0", b.address, 0, 1, 4096, True, 10_000, f"127.0.0.1:{b.data_port}")
        with pytest.raises(BrokerError, match=rf"broker {b.address}: NOT_FOUND: nope 1-0 at offset 0: "):
            list(src.read_partition(part))
    finally:
        b.stop(grace=1)


@pytest.mark.parametrize("data_port", [0, -1])
def test_spark_source_reads_over_the_data_port_or_without_it(spark, tmp_path, zookeeper, zk_root, data_port):
    b = zk_broker(tmp_path, zookeeper, zk_root, "spark", dataPort=data_port, numPartitions=2)
    try:
        for p in ("1-0", "1-1"):
            fill(b, batches=10, per_batch=200, partition=p)
        assert ("dataPort" in registration(zookeeper, zk_root)) == (data_port == 0)
        df = (spark.read.format("metaq").option("metaq.zk.connect", zookeeper.connect_string)
              .option("metaq.zk.root", zk_root).option("subscribe", "t").option("fetchMaxBytes", "8192").load())
        rows = df.select("partition", "offset", "value").collect()
        assert sorted((r.partition, r.offset, r.value) for r in rows) == sorted(
            (p, i * 200 + j, b"m%d-%d" % (i, j)) for p in ("1-0", "1-1") for i in range(10) for j in range(200))
        fetch_data, fetch_raw = served(b, "FetchData"), served(b, "FetchRaw")
        if data_port == 0:
            assert fetch_data > 0 and fetch_raw == 0
        else:
            assert fetch_data == 0 and fetch_raw > 0
    finally:
        b.stop(grace=1)


# -- puts over the data port -------------------------------------------------------------------------

def test_puts_go_over_the_data_port_and_answer_as_put_raw(tmp_path, zookeeper, zk_root):
    """Producers with a ZooKeeper view put over the data port: the same offsets, errors and transactions
    as PutRaw, one connection per partition in flight, reused; a refused put leaves the connection usable."""
    from metaq_broker.client.producer import PipelinedSender
    from metaq_broker.protocol.status import RemoteInvalidArgumentError, RemoteUnknownTopicError
    b = zk_broker(tmp_path, zookeeper, zk_root, "puts", numPartitions=2)
    b.create_topic("two", 2, {})
    try:
        with Producer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as producer, \
                Producer(brokers={1: b.address}, use_data_port=False) as over_grpc, \
                Consumer(zk_connect=zookeeper.connect_string, zk_root=zk_root) as consumer:
            wait_until(lambda: producer.data_address(1) and len(producer.partitions("two")) == 2,
                       what="data port and partitions in the cluster view")
            puts, data_puts = served(b, "Put"), served(b, "PutData")
            r = producer.send_batch("two", [b"a", b"b", b"c"], partition="1-1")
            assert (r[0].partition, r[0].base_offset, r[0].count) == ("1-1", 0, 3) and r[0].fsynced
            assert served(b, "PutData") == data_puts + 1 and served(b, "Put") == puts
            r = over_grpc.send_batch("two", [b"d"], partition="1-1")
            assert (r[0].base_offset, served(b, "Put")) == (3, puts + 1)

            # several partitions in flight at once, each on its own connection, given back when answered
            sender = PipelinedSender(producer)
            for i in range(10):
                sender.send_batch("two", [b"p%d-%d" % (i, j) for j in range(100)], keys=[b"%d" % j for j in range(100)])
            results = sender.flush()
            assert sum(x.count for x in results) == 1000 and {x.partition for x in results} == {"1-0", "1-1"}
            assert len(producer.data_pool._idle[producer.data_address(1)]) == 2
            got = {p: consumer.fetch("two", p, 0, max_messages=2000).batch.column("value").to_pylist() for p in ("1-0", "1-1")}
            assert sum(len(v) for v in got.values()) == 1004 and got["1-1"][:4] == [b"a", b"b", b"c", b"d"]

            # refusals raise the gRPC path's errors, with its messages, and the connection serves on
            body = records.encode_body([b"x"])
            errors = []
            for p in (producer, over_grpc):
                with pytest.raises(RemoteUnknownTopicError) as e:
                    p.start_put("nope", "1-0", body).result()
                errors.append(e.value.details)
            assert errors[0] == errors[1] and "nope" in errors[0]
            bad = records.EncodedBody(body.count, body.attributes, body.parts, body.size, body.crc ^ 1,
                                      body.message_sizes, body.max_message_size)
            with pytest.raises(RemoteInvalidArgumentError, match="checksum mismatch"):
                producer.start_put("two", "1-0", bad).result()
            connects = sum(c.connects for c in producer.data_pool._idle[producer.data_address(1)])
            producer.send_batch("two", [b"after"], partition="1-0")
            assert sum(c.connects for c in producer.data_pool._idle[producer.data_address(1)]) == connects

            # a transaction's puts take the same path and stay invisible until the commit
            data_puts = served(b, "PutData")
            txn = producer.transaction("dp-txn")
            txn.send_batch("two", [b"t1", b"t2"], partition="1-0")
            assert served(b, "PutData") == data_puts + 1
            txn.prepare()
            end = consumer.offset_bounds("two", ["1-0"])["1-0"]
            assert end[1] < end[2]  # last stable offset held back by the prepared transaction
            txn.commit()
            wait_until(lambda: consumer.fetch("two", "1-0", end[1]).batch.column("value").to_pylist()[-2:] == [b"t1", b"t2"],
                       what="committed transaction visible")
    finally:
        b.stop(grace=1)


def test_a_malformed_put_is_refused_and_the_broker_serves_on(tmp_path):
    b = start_broker(tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", b.data_port), timeout=10) as s:
            # a PutRaw request whose header says the body starts past its end
            s.sendall(dataport.PREFIX.pack(48, dataport.PUT, 0) + struct.pack("<IIiIIIHHI", 4096, 0, 0, 1, 0, 0, 0, 0, 0)
                      + b"\0" * 8)
            head = s.recv(dataport.PUT_REPLY.size, socket.MSG_WAITALL)
            n, status = dataport.PUT_REPLY.unpack(head)[:2]
            assert status == 3 and b"body starts at byte 4096" in s.recv(n - len(head), socket.MSG_WAITALL)
            # a put claiming more than the broker takes: refused before its body, the connection closed
            s.sendall(dataport.PREFIX.pack(dataport.MAX_PUT_BYTES + 1, dataport.PUT, 0) + b"\0" * 24)
            head = s.recv(dataport.PUT_REPLY.size, socket.MSG_WAITALL)
            n, status = dataport.PUT_REPLY.unpack(head)[:2]
            assert status == 8 and b"over this broker's limit" in s.recv(n - len(head), socket.MSG_WAITALL)
            assert s.recv(1) == b""
        with DataConnection(f"127.0.0.1:{b.data_port}") as d:  # a put cut short, then a good one
            d.connect()
            d.sock.sendall(dataport.PREFIX.pack(4096, dataport.PUT, 0) + b"\0" * 100)
            d.close()
            body = records.encode_body([b"ok"])
            d.send_put(rawput.pack_parts("t", 0, "", body.count, body.attributes, body.crc, body.parts))
            base_offset, _, _, partition, count, fsynced = d.receive_put()
            assert (base_offset, partition, count, fsynced) == (0, 0, 1, True) and d.connects == 2
    finally:
        b.stop(grace=1)


def test_a_put_whose_broker_dies_before_answering_fails_without_a_resend(cluster):
    """The request reached the broker but no answer came: a producer that is not idempotent fails naming
    that it may be stored (never resent blindly); the next put reconnects to the restarted broker. (An
    idempotent one sends it again: tests/test_idempotent_producer.py.)"""
    from metaq_broker.protocol.status import BrokerUnavailableError
    b = cluster.start_broker(1, {"dataPort": 0}, topics={"t": {"numPartitions": 1}})
    with cluster.client(Producer, timeout=10, idempotent=False) as producer:
        wait_until(lambda: producer.data_address(1) and producer.partitions("t"), what="broker in the cluster view")
        producer.send_batch("t", [b"first"], partition="1-0")
        body = records.encode_body([b"lost?"])
        freeze(b.proc.pid)
        try:
            put = producer.start_put("t", "1-0", body)  # sent into the socket of a frozen broker
        finally:
            b.proc.kill()
            b.proc.wait(10)
        with pytest.raises(BrokerUnavailableError, match="may or may not be stored"):
            put.result()
        cluster.start_broker(1, {"dataPort": 0}, topics={"t": {"numPartitions": 1}})
        wait_until(lambda: producer.data_address(1), what="restarted broker in the cluster view")
        again = producer.send_batch("t", [b"again"], partition="1-0")[0].base_offset
    # "may or may not be stored" is the truth either way: one full run found it stored (the frozen broker had
    # taken it), every other run not; never twice, and nothing but the two puts around it
    with cluster.client(Consumer) as consumer:
        values = consumer.read_range("t", "1-0", 0, again + 1).column("value").to_pylist()
    assert values in ([b"first", b"again"], [b"first", b"lost?", b"again"]), values
