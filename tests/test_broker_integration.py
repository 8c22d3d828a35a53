"""The broker as real processes with a real ZooKeeper: round trips through the client, two brokers on
one topic, restarts and crashes, every error status, duplicate ids, and a fuzz of hostile requests."""
import json
import random

import grpc
import pyarrow as pa
import pytest
from conftest import wait_until
from kazoo.client import KazooClient

from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import PipelinedSender, Producer
from metaq_broker.errors import InvalidMessageError, PartitionClosedError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawput, records
from metaq_broker.protocol.status import (RemoteInvalidArgumentError, RemoteMessageTooLargeError,
                                          RemoteOffsetOutOfRangeError, RemoteUnknownTopicError)
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.process


def read_all(consumer, topic):
    """{partition: [values]} for every partition of the topic."""
    out = {}
    for p, (earliest, latest) in consumer.offsets(topic).items():
        out[p] = consumer.read_range(topic, p, earliest, latest).column("value").to_pylist()
    return out


def test_produce_consume_round_trip_through_zookeeper(cluster):
    cluster.start_broker(1, settings={"numPartitions": 3}, topics={"orders": {}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic in ZooKeeper")
        assert producer.partitions("orders") == ["1-0", "1-1", "1-2"]
        keys = [b"user-%d" % (i % 7) for i in range(300)]
        values = [b"order-%d" % i for i in range(300)]
        results = producer.send_batch("orders", values, keys=keys)
        assert sum(r.count for r in results) == 300 and all(r.fsynced for r in results)
        got = read_all(consumer, "orders")
        assert sorted(v for vs in got.values() for v in vs) == sorted(values)
        # The same key always lands in the same partition, in send order.
        where = {}
        for p, vs in got.items():
            for v in vs:
                i = int(v.split(b"-")[1])
                assert where.setdefault(keys[i], p) == p
        for p, vs in got.items():
            assert vs == sorted(vs, key=lambda v: int(v.split(b"-")[1]))
        # Messages carry their metadata.
        f = consumer.fetch("orders", "1-0", 0, max_messages=1)
        m = f.messages()[0]
        assert (m.partition, m.offset, m.flag, m.attribute) == ("1-0", 0, 0, None) and m.key is not None


def test_async_send_batches_and_resolves_futures(cluster):
    cluster.start_broker(1, topics={"events": {"numPartitions": 2}})
    with cluster.client(Producer, linger_ms=20) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("events"), what="topic")
        futures = [producer.send("events", b"e%d" % i, partition="1-1", attribute="a%d" % i, flag=i)
                   for i in range(50)]
        producer.flush(30)
        results = [f.result() for f in futures]
        assert [r.offset for r in results] == list(range(50))
        assert len({r.msg_id for r in results}) == 50
        batch = consumer.read_range("events", "1-1", 0, 50)
        assert batch.column("value").to_pylist() == [b"e%d" % i for i in range(50)]
        assert batch.column("attribute").to_pylist() == ["a%d" % i for i in range(50)]
        assert batch.column("flag").to_pylist() == list(range(50))
        assert batch.column("msgId").to_pylist() == [r.msg_id for r in results]


def test_two_brokers_host_one_topic(cluster):
    for bid in (1, 2):
        cluster.start_broker(bid, settings={"numPartitions": 2})
    with cluster.client(Admin) as admin, cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: len(admin.masters()) == 2, what="two brokers")
        assert sorted(admin.create_topic("shared", 2)) == ["1-0", "1-1", "2-0", "2-1"]
        wait_until(lambda: len(producer.cluster.topic_partitions("shared")) == 4, what="four partitions")
        for i in range(8):  # no keys: each call goes to the next partition, round robin
            producer.send_batch("shared", [b"m%d-%d" % (i, j) for j in range(10)])
        got = read_all(consumer, "shared")
        assert sorted(got) == ["1-0", "1-1", "2-0", "2-1"]
        assert all(len(v) == 20 for v in got.values())
        described = admin.describe("shared")
        assert sorted((p.partition, p.broker_id, p.latest) for p in described) == [
            ("1-0", 1, 20), ("1-1", 1, 20), ("2-0", 2, 20), ("2-1", 2, 20)]


def test_broker_restart_and_crash_keep_data_and_registration(cluster):
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    zk = KazooClient(cluster.zk_connect)
    zk.start()
    try:
        node = ZkPaths(cluster.zk_root).broker(1)
        assert json.loads(zk.get(node)[0])["port"] == b.port
        with cluster.client(Producer) as producer:
            wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
            producer.send_batch("t", [b"before-%d" % i for i in range(100)])
            assert b.stop() == 0  # SIGTERM: graceful
            wait_until(lambda: zk.exists(node) is None, what="deregistration")
            cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
            wait_until(lambda: zk.exists(node), what="registration after restart")
            producer.send_batch("t", [b"after-%d" % i for i in range(100)])
            cluster.brokers[1].kill()  # SIGKILL: a crash right after acknowledged appends
            cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
            wait_until(lambda: zk.exists(node), what="registration after crash")
        with cluster.client(Consumer) as consumer:
            wait_until(lambda: consumer.cluster.topic_partitions("t"), what="topic")
            values = consumer.read_range("t", "1-0", 0, 200).column("value").to_pylist()
        assert values == [b"before-%d" % i for i in range(100)] + [b"after-%d" % i for i in range(100)]
    finally:
        zk.stop()


def test_every_error_has_its_status_and_a_clear_message(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 2, "maxMessageSize": 1000}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer, \
            cluster.client(Admin) as admin:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        producer.send_batch("t", [b"a", b"b"], partition="1-0")
        conn, _ = consumer.route("1-0")
        with pytest.raises(RemoteUnknownTopicError, match="unknown topic 'nope'"):
            conn.call("Fetch", pb.FetchRequest(topic="nope", partition=0, offset=0))
        with pytest.raises(RemoteInvalidArgumentError, match="no partition 5"):
            conn.call("Fetch", pb.FetchRequest(topic="t", partition=5, offset=0))
        with pytest.raises(RemoteInvalidArgumentError, match="negative"):
            conn.call("Fetch", pb.FetchRequest(topic="t", partition=0, offset=-3))
        with pytest.raises(RemoteOffsetOutOfRangeError, match=r"offset 9 .* valid offsets are 0 .* to 2"):
            consumer.fetch("t", "1-0", 9)
        with pytest.raises(InvalidMessageError, match="value"):  # checked before anything is sent
            producer.send_batch("t", [1, 2], partition="1-0")
        with pytest.raises(RemoteMessageTooLargeError, match="1001 bytes.*limit.*1000"):
            producer.send_batch("t", [b"x" * 1001], partition="1-0")
        with pytest.raises(RemoteInvalidArgumentError, match="checksum"):
            body = records.encode_body([b"hello"])
            conn.call("Put", pb.PutRequest(topic="t", partition=0, batch=pb.MessageBatch(
                count=1, attributes=0, body=b"".join(bytes(p) for p in body.parts), body_crc=body.crc ^ 1)))
        admin.close_partitions("t", 1, 0, 0)
        with pytest.raises(PartitionClosedError, match="closed"):
            producer.send_batch("t", [b"c"], partition="1-0")
        with pytest.raises(PartitionClosedError, match="closed"):
            consumer.fetch("t", "1-0", 0)
        assert [p.closed for p in admin.describe("t")] == [True, False]
        admin.open_partitions("t", 1)
        producer.send_batch("t", [b"c"], partition="1-0")
        assert consumer.read_range("t", "1-0", 0, 3).column("value").to_pylist() == [b"a", b"b", b"c"]
        stats = {p.partition: p for p in admin.stats(1, "t").partitions}
        assert stats["1-0"].put_messages == 3 and stats["1-0"].put_failures >= 3


def test_second_broker_with_the_same_id_refuses_to_start(cluster):
    cluster.start_broker(1)
    from metaq_broker.devtools.broker_process import BrokerProcess
    dup = BrokerProcess(cluster.workdir / "dup", 1, cluster.zk_connect, settings={"zk.root": cluster.zk_root})
    with pytest.raises(RuntimeError, match="exited with code 2") as e:
        dup.start(timeout=30)
    assert "broker id 1" in str(e.value) or "brokerId 1" in str(e.value) or "id 1" in str(e.value)


def test_group_offsets_and_lag(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    with cluster.client(Producer) as producer, cluster.client(Consumer, group="g1") as consumer, \
            cluster.client(Admin) as admin:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        producer.send_batch("t", [b"x"] * 10, partition="1-0")
        producer.send_batch("t", [b"y"] * 4, partition="1-1")
        consumer.commit("t", {"1-0": 6, "1-1": 4})
        assert consumer.committed("t") == {"1-0": 6, "1-1": 4}
        assert "g1" in admin.groups()
        lag = {r.partition: (r.committed, r.latest, r.lag) for r in admin.group_lag("g1", "t")}
        assert lag == {"1-0": (6, 10, 4), "1-1": (4, 4, 0)}


def test_group_members_share_partitions(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 4}})
    with cluster.client(Producer) as producer:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        for p in ["1-0", "1-1", "1-2", "1-3"]:
            producer.send_batch("t", [p.encode() + b":%d" % i for i in range(5)], partition=p)
    a, b = cluster.client(Consumer, group="shared"), cluster.client(Consumer, group="shared")
    try:
        a.subscribe("t", start="earliest")
        b.subscribe("t", start="earliest")
        owned_a = a.subscribe("t", start="earliest")  # rebalance now that both are members
        owned_b = b.subscribe("t", start="earliest")
        assert sorted(owned_a + owned_b) == ["1-0", "1-1", "1-2", "1-3"] and not set(owned_a) & set(owned_b)
        seen = [m.value for c in (a, b) for f in c.poll("t", max_wait_ms=0) for m in f.messages()]
        assert len(seen) == 20 and len(set(seen)) == 20
    finally:
        a.close()
        b.close()


def _raw_call(channel, method, payload: bytes, timeout=5):
    call = channel.unary_unary(f"/metaq.v1.Broker/{method}", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    return call(payload, timeout=timeout)


def test_fuzzed_requests_never_hurt_the_broker_or_its_data(cluster):
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        values = [b"keep-%d" % i for i in range(200)]
        producer.send_batch("t", values, partition="1-0")
        rng = random.Random(1234)
        valid = [
            pb.PutRequest(topic="t", partition=0, batch=pb.MessageBatch(count=1, body=b"x" * 16)).SerializeToString(),
            pb.FetchRequest(topic="t", partition=0, offset=0, max_bytes=100).SerializeToString(),
            pb.GetOffsetsRequest(queries=[pb.OffsetQuery(topic="t", partition=1)]).SerializeToString(),
            pb.CreateTopicRequest(topic="../evil", num_partitions=1).SerializeToString(),
            rawput.pack("t", 0, "", 1, 0, records.crc(b"x" * 16), [b"x" * 16]),
        ]
        methods = ["Put", "PutRaw", "Fetch", "GetOffsets", "DescribeTopic", "CreateTopic", "ClosePartitions", "Stats"]
        with grpc.insecure_channel(b.address) as channel:
            for i in range(400):
                kind = i % 4
                if kind == 0:
                    payload = rng.randbytes(rng.randint(0, 200))
                elif kind == 1:
                    v = rng.choice(valid)
                    payload = v[: rng.randint(0, len(v))]
                elif kind == 2:
                    v = bytearray(rng.choice(valid))
                    for _ in range(rng.randint(1, 4)):
                        if v:
                            v[rng.randrange(len(v))] = rng.randrange(256)
                    payload = bytes(v)
                else:  # a well-formed Put or PutRaw whose batch body is hostile
                    body = rng.randbytes(rng.choice([8, 16, 64]))
                    partition, count, attributes = rng.choice([0, 1, -1]), rng.randint(0, 5), rng.randint(0, 3)
                    payload = pb.PutRequest(topic="t", partition=partition, batch=pb.MessageBatch(
                        count=count, attributes=attributes, body=body,
                        body_crc=records.crc(body))).SerializeToString() if i % 8 == 3 else \
                        rawput.pack("t", partition, "", count, attributes, records.crc(body), [body])
                method = rng.choice(methods) if kind < 3 else "Put" if i % 8 == 3 else "PutRaw"
                try:
                    _raw_call(channel, method, payload)
                except grpc.RpcError as e:
                    assert e.code() != grpc.StatusCode.UNAVAILABLE, e.details()
                    assert method != "PutRaw" or e.code() != grpc.StatusCode.INTERNAL, e.details()
        # Still serving, and what was stored before is intact (the fuzz may have closed partitions).
        with cluster.client(Admin) as admin:
            admin.open_partitions("t", 1)
        assert consumer.read_range("t", "1-0", 0, 200).column("value").to_pylist() == values
        producer.send_batch("t", [b"after"], partition="1-0")
    assert b.stop() == 0
    from metaq_broker.store import PartitionLog, TopicConfig
    for p in (0, 1):
        log = PartitionLog.open(b.workdir / "data" / f"t-{p}", "t", p, TopicConfig())
        assert log.verify() == []
        log.close()
    assert not (b.workdir / "data" / "..").joinpath("evil-0").exists()


def test_broker_registers_again_after_zookeeper_restarts(tmp_path, own_zookeeper):
    from conftest import Cluster

    with own_zookeeper as zk_server:
        c = Cluster(tmp_path, zk_server.connect_string, "/meta")
        try:
            c.start_broker(1, topics={"t": {}})
            watcher = KazooClient(zk_server.connect_string)
            watcher.start()
            wait_until(lambda: watcher.exists(ZkPaths("/meta").broker(1)), what="registration")
            watcher.stop()
            zk_server.restart(down_for=5.0)  # longer than the broker's 4 s session timeout
            watcher = KazooClient(zk_server.connect_string)
            watcher.start()
            try:
                wait_until(lambda: watcher.exists(ZkPaths("/meta").broker(1)), timeout=40, what="registration after restart")
            finally:
                watcher.stop()
            with c.client(Producer) as producer, c.client(Consumer) as consumer:
                wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
                producer.send_batch("t", [b"after zk restart"])
                assert consumer.fetch("t", "1-0", 0).messages()[0].value == b"after zk restart"
        finally:
            c.stop()


def test_fetch_raw_returns_what_fetch_returns(cluster):
    cluster.start_broker(1, topics={"raw": {}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer:
        wait_until(lambda: producer.cluster.topic_partitions("raw"), what="topic")
        for i in range(5):
            producer.send_batch("raw", [b"m%d-%d" % (i, j) for j in range(100)], partition="1-0")
        conn, _ = consumer.route("1-0")
        for offset, max_bytes, max_messages in ((0, 1 << 20, 0), (150, 1024, 0), (250, 1 << 20, 120), (500, 0, 0)):
            request = pb.FetchRequest(topic="raw", partition=0, offset=offset, max_bytes=max_bytes,
                                      max_messages=max_messages)
            full, raw = conn.call("Fetch", request), conn.call("FetchRaw", request)
            assert (raw.start_offset, raw.end_offset, raw.earliest_offset, raw.latest_offset, bytes(raw.records)) == \
                (full.start_offset, full.end_offset, full.earliest_offset, full.latest_offset, full.records)
        with pytest.raises(RemoteOffsetOutOfRangeError, match=r"0 \(earliest\) to 500"):
            conn.call("FetchRaw", pb.FetchRequest(topic="raw", partition=0, offset=501))


def test_putraw_refusals_carry_the_same_statuses_as_put(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 1, "maxMessageSize": 100}})
    with cluster.client(Producer) as producer:
        wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic")
        conn, _ = producer.route("1-0")
        body = records.encode_body([b"hello"])

        def put_raw(topic="t", partition=0, crc=body.crc, parts=body.parts, count=body.count):
            return conn.call("PutRaw", rawput.pack(topic, partition, "", count, body.attributes, crc, parts))

        assert put_raw().count == 1
        with pytest.raises(RemoteInvalidArgumentError, match="checksum"):
            put_raw(crc=body.crc ^ 1)
        with pytest.raises(RemoteInvalidArgumentError, match="too short"):
            put_raw(count=1000)
        with pytest.raises(RemoteUnknownTopicError, match="nope"):
            put_raw(topic="nope")
        with pytest.raises(RemoteInvalidArgumentError, match="no partition 3"):
            put_raw(partition=3)
        with pytest.raises(RemoteInvalidArgumentError, match="shorter than"):
            conn.call("PutRaw", b"\0" * 8)
        big = records.encode_body([b"x" * 101])
        with pytest.raises(RemoteMessageTooLargeError):
            conn.call("PutRaw", rawput.pack("t", 0, "", 1, big.attributes, big.crc, big.parts))


def test_pipelined_sender_keeps_each_partitions_order_and_reports_failures(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 3}})
    with cluster.client(Producer) as producer, cluster.client(Consumer) as consumer, \
            cluster.client(Admin) as admin:
        wait_until(lambda: len(producer.cluster.topic_partitions("t")) == 3, what="topic")
        sender = PipelinedSender(producer, max_bytes=1 << 20)
        sent = 0
        for i in range(40):  # round robin, keyed, and one partition: several Puts in flight at once
            values = [b"%06d" % (sent + j) for j in range(50 + i)]
            keys = [b"k%d" % (j % 5) for j in range(len(values))] if i % 3 == 1 else None
            sender.send_batch("t", pa.array(values), keys=keys, partition="1-2" if i % 3 == 2 else None)
            sent += len(values)
        results = sender.flush()
        assert sum(r.count for r in results) == sent and sender.flush() == []
        got = read_all(consumer, "t")
        assert sorted(v for vs in got.values() for v in vs) == [b"%06d" % i for i in range(sent)]
        for vs in got.values():  # each partition in send order
            assert vs == sorted(vs)
        for p in got:  # results name where each batch went
            assert sum(r.count for r in results if r.partition == p) == len(got[p])
        admin.close_partitions("t", 1, 1, 1)
        with pytest.raises(PartitionClosedError):
            for _ in range(3):
                sender.send_batch("t", [b"x"], partition="1-1")
            sender.flush()
        sender.close()
        assert sender.flush() == []
