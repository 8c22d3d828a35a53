"""The Kafka listener with real Kafka clients (confluent-kafka, kafka-python, kcat) against real broker
processes and a real ZooKeeper: produce every way a client can (keys, headers, codecs, acks, idempotent),
consume by assignment and in a group that rebalances, commit and resume, seek by time, admin calls; what
Kafka clients write is what metaq's own client reads, and the other way round."""
from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from metaq_broker.client import Consumer as MetaqConsumer
from metaq_broker.client import Producer as MetaqProducer
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.protocol import decode_response, encode_request
from conftest import wait_until

pytestmark = pytest.mark.process

QUIET = {"log_level": 3}  # librdkafka: errors only


@pytest.fixture
def broker(cluster):
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    wait_until(lambda: _partitions(b.bootstrap, "t") == 2, what="topic t in Kafka metadata")
    return b


def _partitions(bootstrap: str, topic: str) -> int:
    md = AdminClient({"bootstrap.servers": bootstrap, **QUIET}).list_topics(topic, timeout=5)
    t = md.topics.get(topic)
    return 0 if t is None or t.error is not None else len(t.partitions)


def _create(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, **QUIET})
    admin.create_topics([NewTopic(topic, partitions)])[topic].result(15)
    wait_until(lambda: _partitions(bootstrap, topic) == partitions, what=f"topic {topic} in metadata")


def _produce(bootstrap: str, topic: str, messages: list, **conf) -> list:
    """Produce ``messages`` (key, value, headers, timestamp ms); returns the delivery reports' errors."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, **QUIET, **conf})
    errors = []
    for key, value, headers, ts in messages:
        p.produce(topic, value=value, key=key, headers=headers, timestamp=ts or 0,
                  on_delivery=lambda err, msg: errors.append(err) if err else None)
    assert p.flush(30) == 0
    return errors


def _consume(bootstrap: str, topic: str, partitions: int, count: int, timeout: float = 30, **conf) -> list:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False, **QUIET, **conf})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < count and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            assert m.error() is None, m.error()
            got.append(m)
    finally:
        c.close()
    return got


def _messages(n: int, base_ts: int) -> list:
    return [(None if i % 3 == 0 else b"k%d" % i, b"v%d" % i * (i % 7 + 1),
             [("h", b"x%d" % i), ("n", None)] if i % 2 else None, base_ts + i) for i in range(n)]


def _by_time(row: tuple) -> int:
    return row[3]


def _as_sent(m) -> tuple:
    return m.key(), m.value(), m.headers(), m.timestamp()[1]


def test_confluent_produce_every_way_and_read_back_by_kafka_and_metaq_clients(broker, cluster):
    """Plain, keyed, headers, null keys, CreateTime; every codec; acks 0, 1 and all: a Kafka consumer reads
    what was sent, and metaq's own Consumer reads the same keys, values, headers and create times."""
    bs = broker.bootstrap
    base_ts = int(time.time() * 1000) - 60_000
    sent = _messages(60, base_ts)
    expected = sorted(((k, v, h or None, ts) for k, v, h, ts in sent), key=_by_time)
    cases = [("none", "all"), ("gzip", "1"), ("snappy", "all"), ("lz4", "all"), ("zstd", "all"), ("none", "0")]
    metaq = cluster.client(MetaqConsumer)
    try:
        for codec, acks in cases:
            topic = f"c-{codec}-{acks}"
            _create(bs, topic, 2)
            assert _produce(bs, topic, sent, **{"compression.codec": codec, "acks": acks}) == []
            got = _consume(bs, topic, 2, len(sent))
            assert sorted((_as_sent(m) for m in got), key=_by_time) == expected, (codec, acks)
            # metaq's Consumer over its own protocol: the same records, headers and create times
            rows = []
            for name in ("1-0", "1-1"):
                f = metaq.fetch(topic, name, 0, headers=True)
                d = f.batch.to_pydict()
                ts = f.batch.column("timestamp").cast(pa.int64()).to_pylist()
                for k, v, h, t, tt in zip(d["key"], d["value"], d["headers"], ts, d["timestampType"]):
                    assert tt == 0  # CreateTime, as the Kafka producer stamped it
                    rows.append((k, v, [(e["key"], e["value"]) for e in h] if h else None, t))
            assert sorted(rows, key=_by_time) == expected, (codec, acks)
    finally:
        metaq.close()


def test_idempotent_producer_stores_each_message_once(broker):
    bs = broker.bootstrap
    n = 500
    errors = _produce(bs, "t", [(b"k%d" % (i % 10), b"%d" % i, None, None) for i in range(n)],
                      **{"enable.idempotence": True, "acks": "all", "max.in.flight.requests.per.connection": 5})
    assert errors == []
    got = _consume(bs, "t", 2, n + 1, timeout=5)
    assert sorted(int(m.value()) for m in got) == list(range(n))
    for p in (0, 1):  # per key, in order
        values = [int(m.value()) for m in got if m.partition() == p]
        by_key = {}
        for m in (m for m in got if m.partition() == p):
            by_key.setdefault(m.key(), []).append(int(m.value()))
        assert all(v == sorted(v) for v in by_key.values()) and len(values) == sum(map(len, by_key.values()))


def test_transactional_producer_is_refused_naming_the_setting(broker):
    p = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": "tx-1", **QUIET})
    with pytest.raises(Exception) as e:
        p.init_transactions(10)
    assert "transactional.id" in str(e.value)


def test_group_of_two_rebalances_commits_and_resumes(broker):
    """Two members share the topic's partitions; when one leaves the other takes both; commits are kept
    where metaq keeps group offsets, and a new member resumes from them."""
    bs, group = broker.bootstrap, f"g-{uuid.uuid4().hex[:6]}"
    assert _produce(bs, "t", [(b"k%d" % i, b"%d" % i, None, None) for i in range(100)]) == []
    conf = {"bootstrap.servers": bs, "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 500, **QUIET}
    a, b = Consumer(conf), Consumer(conf)
    a.subscribe(["t"])
    b.subscribe(["t"])
    seen = {}

    def poll_both():
        for c in (a, b):
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                seen[(m.partition(), m.offset())] = c
        return len(a.assignment()) == 1 and len(b.assignment()) == 1
    wait_until(poll_both, timeout=60, what="both members with one partition each")
    b.close()  # leaves the group: a rebalance gives a both partitions

    def poll_a():
        m = a.poll(0.2)
        if m is not None and m.error() is None:
            seen[(m.partition(), m.offset())] = a
        return len(a.assignment()) == 2 and len(seen) == 100
    wait_until(poll_a, timeout=60, what="a owning both partitions and every message seen")
    ends = {p: max(o for q, o in seen if q == p) + 1 for p in (0, 1)}
    half = {p: ends[p] // 2 for p in ends}
    a.commit(offsets=[TopicPartition("t", p, o) for p, o in half.items()], asynchronous=False)
    committed = a.committed([TopicPartition("t", p) for p in (0, 1)], timeout=10)
    assert {tp.partition: tp.offset for tp in committed} == half
    a.close()
    c = Consumer(conf)  # resumes from the commit
    c.subscribe(["t"])
    rest = set()
    deadline = time.monotonic() + 60
    while len(rest) < sum(ends[p] - half[p] for p in ends) and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            rest.add((m.partition(), m.offset()))
    c.close()
    assert rest == {(p, o) for p in ends for o in range(half[p], ends[p])}


def test_offsets_for_times_and_list_offsets(broker):
    bs = broker.bootstrap
    assert _produce(bs, "t", [(None, b"early", None, None)]) == []
    time.sleep(0.05)  # store times: the next batch must be stored strictly later
    middle = int(time.time() * 1000)
    time.sleep(0.05)
    assert _produce(bs, "t", [(None, b"late", None, None)]) == []
    c = Consumer({"bootstrap.servers": bs, "group.id": "x", **QUIET})
    try:
        found = []
        for p in (0, 1):
            lo, hi = c.get_watermark_offsets(TopicPartition("t", p), timeout=10)
            (tp,) = c.offsets_for_times([TopicPartition("t", p, middle)], timeout=10)
            found.append((lo, hi, tp.offset))
        # round robin of two single-message batches: one in each partition or both in one
        assert sum(hi for _, hi, _ in found) == 2
        late = [tp for lo, hi, tp in found if tp >= 0]
        assert len(late) == 1
        c.assign([TopicPartition("t", p, o) for p, (_, _, o) in enumerate(found) if o >= 0])
        m = c.poll(10)
        assert m is not None and m.value() == b"late"
    finally:
        c.close()


def test_metaq_producer_to_kafka_consumer(broker, cluster):
    p = cluster.client(MetaqProducer)
    ts = int(time.time() * 1000) - 5000
    try:
        p.send_batch("t", [b"a", b"b", None], keys=[b"ka", None, b"kc"],
                     headers=[[("h1", b"1")], None, [("h2", None)]], timestamps=[ts, ts + 1, ts + 2], partition="1-1")
    finally:
        p.close()
    got = _consume(broker.bootstrap, "t", 2, 3)
    assert sorted((m.key() or b"", m.value() or b"", m.headers(), m.timestamp()) for m in got) == sorted([
        (b"ka", b"a", [("h1", b"1")], (1, ts)), (b"", b"b", None, (1, ts + 1)),
        (b"kc", b"", [("h2", None)], (1, ts + 2))])
    assert {m.partition() for m in got} == {1}


def test_read_committed_skips_metaq_aborted_and_open_transactions(broker, cluster):
    """metaq transactions: an aborted one and an open one are not read; the markers leave offsets a Kafka
    consumer moves past (its position reaches the last stable offset)."""
    p = cluster.client(MetaqProducer)
    try:
        p.send_batch("t", [b"before"], partition="1-0")
        tx = p.transaction("sink-a/1")
        tx.send_batch("t", [b"aborted-1", b"aborted-2"], partition="1-0")
        tx.rollback()
        p.send_batch("t", [b"after"], partition="1-0")
        tx2 = p.transaction("sink-a/2")
        tx2.send_batch("t", [b"committed"], partition="1-0")
        tx2.prepare()
        tx2.commit()
        open_tx = p.transaction("sink-a/3")
        open_tx.send_batch("t", [b"open"], partition="1-0")
        for isolation in ("read_committed", "read_uncommitted"):
            c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "x", "isolation.level": isolation,
                          "enable.auto.commit": False, **QUIET})
            c.assign([TopicPartition("t", 0, 0)])
            values = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                m = c.poll(0.3)
                if m is not None and m.error() is None:
                    values.append(m.value())
                (pos,) = c.position([TopicPartition("t", 0)])
                if len(values) == 3 and pos.offset >= 0:
                    lo, hi = c.get_watermark_offsets(TopicPartition("t", 0), timeout=5)
                    if pos.offset == hi:
                        break
            c.close()
            assert values == [b"before", b"after", b"committed"], isolation
        open_tx.rollback()
    finally:
        p.close()


def test_kafka_python_and_kcat(broker):
    from kafka import KafkaConsumer, KafkaProducer
    bs = broker.bootstrap
    kp = KafkaProducer(bootstrap_servers=bs, compression_type="gzip")
    for i in range(10):
        kp.send("t", key=b"k%d" % i, value=b"kp%d" % i, headers=[("src", b"kafka-python")]).get(timeout=20)
    kp.close()
    kcat = shutil.which("kcat")
    assert kcat, "kcat (Debian's kcat package) is needed: apt-get install kcat"
    listing = subprocess.run([kcat, "-b", bs, "-L", "-t", "t"], capture_output=True, text=True, timeout=30)
    assert listing.returncode == 0 and "2 partitions" in listing.stdout, listing.stdout + listing.stderr
    put = subprocess.run([kcat, "-b", bs, "-P", "-t", "t", "-p", "0", "-K", ":"], input="kk:from-kcat\n",
                         capture_output=True, text=True, timeout=30)
    assert put.returncode == 0, put.stderr
    kc = KafkaConsumer(bootstrap_servers=bs, auto_offset_reset="earliest", consumer_timeout_ms=5000,
                       enable_auto_commit=False)
    kc.assign([__import__("kafka").TopicPartition("t", p) for p in (0, 1)])
    kc.seek_to_beginning()
    got = {m.value: (m.key, m.headers) for m in kc}
    kc.close()
    assert got[b"from-kcat"] == (b"kk", [])
    assert all(got[b"kp%d" % i] == (b"k%d" % i, [("src", b"kafka-python")]) for i in range(10))
    read = subprocess.run([kcat, "-b", bs, "-C", "-t", "t", "-o", "beginning", "-e", "-f", "%k=%s\\n"],
                          capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    lines = set(read.stdout.split())
    assert "kk=from-kcat" in lines and all(f"k{i}=kp{i}" in lines for i in range(10))


# -- the protocol itself, over a socket ----------------------------------------------------------------

def _exchange(port: int, frame: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(frame)
        return _read_frame(s)


def _read_frame(s) -> bytes:
    head = _recv(s, 4)
    return _recv(s, struct.unpack(">i", head)[0])


def _recv(s, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def test_api_versions_at_every_version_and_the_unsupported_answer(broker):
    port = broker.kafka_port
    for v in range(5):
        body = {"client_software_name": "metaq-test", "client_software_version": "1.0"}
        cid, answer = decode_response(18, v, _exchange(port, encode_request(18, v, 7, "t", body)))
        assert cid == 7 and answer["error_code"] == codes.NONE
        assert {k["api_key"] for k in answer["api_keys"]} >= {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 18, 19, 22}
    # v5, unknown to us: answered in v0 with error 35 and the ranges (KIP-511), so the client retries
    frame = struct.pack(">hhih", 18, 5, 9, 1) + b"t" + b"\0\0\0"
    cid, answer = decode_response(18, 0, _exchange(port, struct.pack(">i", len(frame)) + frame))
    assert cid == 9 and answer["error_code"] == codes.UNSUPPORTED_VERSION
    assert any(k["api_key"] == 18 and k["max_version"] == 4 for k in answer["api_keys"])


def test_the_compiled_walks_load_at_the_first_kafka_connection_not_at_start(cluster):
    """A broker that no Kafka client reaches never loads numba (at start it cost every broker a second of
    CPU); its first Kafka connection loads the walks in the background, even when that connection is an
    attacker's, and a produce behind it is served. (Started as an operator starts it: the test suite's
    zygote, devtools/zygote.py, loads them before it forks its brokers.)"""
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 1}}, forkable=False)
    maps = Path(f"/proc/{b.proc.pid}/maps")
    with MetaqProducer(zk_connect=cluster.zk_connect, zk_root=cluster.zk_root) as producer:
        producer.send_batch("t", [b"unkeyed"] * 10)  # metaq's own puts need no compiled walk either
    assert "llvmlite" not in maps.read_text(), "numba loaded by a broker no Kafka client has reached"
    with socket.create_connection(("127.0.0.1", b.kafka_port), timeout=10) as s:  # the first connection:
        s.sendall(struct.pack(">i", 2_000_000_000) + b"x" * 100)  # a huge declared size
        assert s.recv(100) == b""  # closed, nothing answered
    body = {"client_software_name": "metaq-test", "client_software_version": "1.0"}
    cid, answer = decode_response(18, 3, _exchange(b.kafka_port, encode_request(18, 3, 1, "t", body)))
    assert answer["error_code"] == codes.NONE
    wait_until(lambda: "llvmlite" in maps.read_text(), what="numba loaded after the first Kafka connection")
    wait_until(lambda: "kafka: compiled kernels loaded in" in b.log_path.read_text(), what="the warm-up logged")
    assert _produce(b.bootstrap, "t", [(b"k", b"v", [("h", b"1")], None)]) == []


def test_hostile_frames_close_the_connection_and_the_broker_serves_on(broker):
    port = broker.kafka_port
    for hostile in (struct.pack(">i", 2_000_000_000) + b"x" * 100,  # a huge declared size
                    struct.pack(">i", -5),  # a negative one
                    struct.pack(">i", 12) + b"\xff" * 12,  # an unknown API key
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):  # not Kafka at all
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(hostile)
            s.settimeout(10)
            assert s.recv(100) == b""  # closed, nothing answered
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # a slow sender: half a request
        s.sendall(struct.pack(">i", 100) + b"\0\x12")
        assert broker.proc.poll() is None
    cid, answer = decode_response(18, 3, _exchange(port, encode_request(18, 3, 1, "t", {
        "client_software_name": "x", "client_software_version": "1"})))
    assert answer["error_code"] == codes.NONE
    assert _partitions(broker.bootstrap, "t") == 2


def test_unknown_topic_and_partition_answers(broker):
    errors = _produce(broker.bootstrap, "t", [(None, b"x", None, None)])
    assert errors == []
    p = Producer({"bootstrap.servers": broker.bootstrap, "message.timeout.ms": 3000, **QUIET})
    failed = []
    p.produce("no-such-topic", b"x", on_delivery=lambda err, msg: failed.append(err))
    p.flush(10)
    assert failed and failed[0].code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._MSG_TIMED_OUT,
                                           KafkaError._UNKNOWN_TOPIC)


def test_auto_create_topics_only_where_the_broker_allows_it(cluster):
    off = cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    on = cluster.start_broker(2, {"autoCreateTopics": "true", "numPartitions": 3})
    for b in (off, on):
        wait_until(lambda: _partitions(b.bootstrap, "t") == 1, what="t in metadata")
    assert _partitions(off.bootstrap, "fresh-1") == 0  # refused: autoCreateTopics is false on broker 1
    assert _produce(on.bootstrap, "fresh-2", [(None, b"x", None, None)]) == []  # created by its Metadata request
    assert _partitions(on.bootstrap, "fresh-2") == 3
    assert _partitions(off.bootstrap, "fresh-2") == 3  # created on broker 2, seen from every broker
    assert [m.value() for m in _consume(off.bootstrap, "fresh-2", 3, 1)] == [b"x"]


def test_describe_configs_and_cluster(broker):
    from confluent_kafka.admin import ConfigResource
    admin = AdminClient({"bootstrap.servers": broker.bootstrap, **QUIET})
    (res, fut), = admin.describe_configs([ConfigResource("topic", "t")]).items()
    configs = {k: v.value for k, v in fut.result(15).items()}
    assert configs["numPartitions"] == "2" and configs["max.message.bytes"] == configs["maxMessageSize"]
    assert configs["retention.ms"] == str(168 * 3_600_000)
    described = admin.describe_cluster().result(15)
    assert [(n.id, n.host, n.port) for n in described.nodes] == [(1, "127.0.0.1", broker.kafka_port)]


def test_aiokafka_produce_and_consume_in_a_group(broker):
    import asyncio

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, enable_idempotence=True,
                                    compression_type="lz4")
        await producer.start()
        try:
            for i in range(20):
                await producer.send_and_wait("t", b"aio%d" % i, key=b"k%d" % i, headers=[("via", b"aiokafka")])
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer("t", bootstrap_servers=broker.bootstrap, group_id="aio-group",
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        got = {}
        try:
            async def take():
                async for m in consumer:
                    got[m.value] = (m.key, list(m.headers))
                    if len(got) == 20:
                        return
            await asyncio.wait_for(take(), 60)
            await consumer.commit()
            committed = {p: await consumer.committed(p) for p in consumer.assignment()}
        finally:
            await consumer.stop()
        return got, committed

    got, committed = asyncio.run(run())
    assert got == {b"aio%d" % i: (b"k%d" % i, [("via", b"aiokafka")]) for i in range(20)}
    assert sum(committed.values()) == 20


NODE_DIR = Path(__file__).resolve().parent / "node"


def test_kafkajs_produce_and_consume_in_a_group(broker):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (apt-get install nodejs npm; then npm install --prefix tests/node "
                    "kafkajs@2, as .ci/run does)")
    assert (NODE_DIR / "node_modules" / "kafkajs").is_dir(), \
        "kafkajs is missing: npm install --prefix tests/node kafkajs@2 (.ci/run does it)"
    r = subprocess.run([node, str(NODE_DIR / "kafkajs_roundtrip.js"), broker.bootstrap, "t", "10"],
                       capture_output=True, text=True, timeout=120, cwd=NODE_DIR)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted((x["key"], x["value"], x["via"]) for x in rows) == sorted(
        (f"k{i}", f"js{i}", "kafkajs") for i in range(10))
