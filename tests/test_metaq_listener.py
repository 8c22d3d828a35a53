"""The MetaQ listener (``metaqPort``) against real brokers, spoken to by the test MetaQ client
(tests/metaq_client.py, written from the protocol description, not from metaq's code): every line form,
valid and malformed; puts pipelined on one connection stored as one batch and answered in order; byte
positions that add up to the next message across batches, segments and retention; 301s a consumer
follows; transactions local and XA; a consumer group committing MetaQ's offsets in ZooKeeper."""
import dataclasses
import socket
import zlib

import pytest
from kazoo.client import KazooClient

from conftest import wait_until
from metaq_broker.client.consumer import Consumer
from metaq_broker.security.tls import ANONYMOUS
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from tests.metaq_client import Cluster, Connection, GroupConsumer, decode_messages, message_data

pytestmark = pytest.mark.process

TOPIC = "orders"
INT64_MAX = (1 << 63) - 1


def size(value: bytes, attribute=None) -> int:
    """A message's bytes in MetaQ's layout (seed notes §2.2): 20-byte head, attribute, payload."""
    return 20 + len(value) + (0 if attribute is None else 4 + len(attribute.encode()))


@pytest.fixture
def broker(tmp_path):
    """An in-process broker without ZooKeeper, its MetaQ listener on a free port."""
    ini = tmp_path / "broker.ini"
    ini.write_text("[system]\nnumPartitions=2\nmaxSegmentSize=4096\nmaxMessageSize=65536\n\n"
                   f"[topic={TOPIC}]\n\n[topic=small]\nnumPartitions=1\n")
    b = Broker(load(str(ini), {"brokerId": "1", "serverPort": "0", "zk.connect": "none", "kafkaPort": "0", "metaqPort": "0",
                               "dataPath": str(tmp_path / "data")})).start()
    yield b
    b.stop()


@pytest.fixture
def conn(broker):
    c = Connection("127.0.0.1", broker.metaq_port)
    yield c
    c.sock.close()


def put(conn, topic, partition, value, attribute=None, flag=0, checksum=True, tokens=7):
    bit, data = message_data(value, attribute)
    line = ["put", topic, partition, len(data), flag | bit]
    if tokens >= 7:
        line.append(zlib.crc32(data) & 0x7FFFFFFF if checksum else -1)
    return conn.call(line, data)


def get(conn, topic, partition, offset, max_size=1 << 20, group="g"):
    return conn.call(["get", topic, group, partition, offset, max_size])


# -- put and get --------------------------------------------------------------------------------------

def test_puts_in_every_form_are_read_back_at_the_positions_they_were_given(conn):
    sent = [(b"first", None, 0, 7), (b"with an attribute", "colour=red", 4, 7), (b"legacy", None, 0, 6),
            (b"no checksum", "a", 2, 7)]
    position = 0
    ids = []
    for value, attribute, flag, tokens in sent:
        reply = put(conn, TOPIC, 0, value, attribute, flag, checksum=(value != b"no checksum"), tokens=tokens)
        assert reply.code == 200, reply.text
        msg_id, partition, at = reply.text.split(" ")
        assert (int(partition), int(at)) == (0, position)  # the byte position MetaQ would give it
        ids.append(int(msg_id))
        position += size(value, attribute)
    assert ids == sorted(ids) and len(set(ids)) == 4

    reply = get(conn, TOPIC, 0, 0)
    assert reply.kind == "value"
    messages, used = decode_messages(reply.body, 0)
    assert used == len(reply.body) == position
    assert [(m.value, m.attribute, m.flag & ~1, m.msg_id) for m in messages] == \
           [(v, a, f, i) for (v, a, f, _), i in zip(sent, ids)]
    assert [m.offset for m in messages] == [0, size(b"first"), size(b"first") + size(b"with an attribute",
                                                                                      "colour=red"),
                                            position - size(b"no checksum", "a")]
    # from the second message's position on; at the end nothing yet (404)
    reply = get(conn, TOPIC, 0, messages[1].offset)
    assert [m.value for m in decode_messages(reply.body, messages[1].offset)[0]] == [v for v, *_ in sent[1:]]
    reply = get(conn, TOPIC, 0, position)
    assert (reply.kind, reply.code) == ("result", 404)


def test_partition_minus_one_picks_one_and_the_opaque_is_echoed(conn):
    seen = set()
    for i in range(6):
        opaque = conn.send(["put", TOPIC, -1, 1, 0, zlib.crc32(b"x") & 0x7FFFFFFF], b"x", opaque=1000 + i)
        reply = conn.read_reply()
        assert (reply.code, reply.opaque) == (200, opaque)
        seen.add(int(reply.text.split(" ")[1]))
    assert seen == {0, 1}  # both partitions, in turn


def test_pipelined_puts_are_one_batch_and_answered_in_order(broker, conn):
    values = [b"m%03d" % i for i in range(200)]
    wire = b"".join(b"put %s 0 %d 0 %d %d\r\n" % (TOPIC.encode(), len(v), zlib.crc32(v) & 0x7FFFFFFF, 10 + i) + v
                    for i, v in enumerate(values))
    conn.sock.sendall(wire)  # one send: the broker reads them together
    replies = [conn.read_reply() for _ in values]
    assert [r.opaque for r in replies] == list(range(10, 210))
    assert [int(r.text.split(" ")[2]) for r in replies] == [i * size(values[0]) for i in range(200)]
    part = broker.store.partition(TOPIC, 0)
    batches = len(part.read(0, 1 << 20).batch_positions)
    assert batches < 10, f"200 pipelined puts were stored as {batches} batches"
    messages, _ = decode_messages(get(conn, TOPIC, 0, 0).body, 0)
    assert [m.value for m in messages] == values


def test_gets_add_up_across_batches_and_segments_and_follow_301s(broker, conn):
    values = [bytes([65 + i % 26]) * (50 + i * 7 % 300) for i in range(120)]  # ~23 KB: several 4 KiB segments
    positions = []
    for i in range(0, 120, 8):  # batches of 8 pipelined puts
        for v in values[i:i + 8]:
            conn.send(["put", "small", 0, len(v), 0, -1], v)
        positions += [int(conn.read_reply().text.split(" ")[2]) for _ in values[i:i + 8]]
    assert len(broker.store.partition("small", 0).segments()) > 3
    got, position = [], 0
    while True:
        reply = get(conn, "small", 0, position, max_size=1000)
        if reply.kind == "result":
            assert reply.code == 404, reply.text
            break
        messages, used = decode_messages(reply.body, position)
        assert messages and used == len(reply.body)  # whole messages only
        got += messages
        position += used
    assert [m.value for m in got] == values and [m.offset for m in got] == positions

    # inside a message: 301 back to its start; too small a maxSize: a cut message the client doubles for
    reply = get(conn, "small", 0, positions[5] + 3)
    assert (reply.code, reply.text) == (301, str(positions[5]))
    reply = get(conn, "small", 0, positions[5], max_size=10)
    assert reply.kind == "value" and len(reply.body) == 10 and decode_messages(reply.body, 0) == ([], 0)
    reply = get(conn, "small", 0, INT64_MAX)  # MetaQ's alwaysConsumeFromMaxOffset
    assert (reply.code, reply.text) == (301, str(position))
    assert get(conn, "small", 0, position + 1).code == 404
    assert get(conn, "small", 0, -5).code == 301  # before the start: to the first message
    # ``offset``: the nearest valid position
    assert conn.ok(["offset", "small", "g", 0, positions[7] + 1]) == str(positions[7])  # inside: its start
    assert conn.ok(["offset", "small", "g", 0, positions[7]]) == str(positions[7])
    assert conn.ok(["offset", "small", "g", 0, 10 ** 12]) == str(position)

    # retention removes the first segments: their positions move to the first message left
    part = broker.store.partition("small", 0)
    part.config = dataclasses.replace(part.config, retention_bytes=8192)  # as retentionBytes=8192 would
    removed = part.apply_retention()
    assert removed and part.earliest_offset > 0
    first = positions[part.earliest_offset]
    reply = get(conn, "small", 0, 0)
    assert (reply.code, reply.text) == (301, str(first))
    messages, _ = decode_messages(get(conn, "small", 0, first).body, first)
    assert messages[0].value == values[part.earliest_offset]


# -- the other commands ---------------------------------------------------------------------------------

def test_version_stats_and_quit(broker, conn):
    assert conn.version()
    reply = conn.call(["version"])
    assert reply.code == 200
    put(conn, TOPIC, 0, b"counted")
    for item in ([""], ["topics"], ["offsets"], ["realtime"], [TOPIC]):  # "": none, "stats  <opaque>"
        text = conn.ok(["stats", *item])
        assert text.startswith("STATS\r\n") and text.endswith("END\r\n"), (item, text)
        lines = dict(line.split(" ", 1) for line in text.split("\r\n")[1:-2])
        if item == [""]:
            assert lines["broker_id"] == "1" and int(lines["cmd_put"]) >= 1
        if item == ["topics"]:
            assert TOPIC in lines and "small" in lines
        if item == [TOPIC]:
            assert lines["partitions"] == "2" and lines["message_count"] == "1"
    assert conn.call(["stats", "config"]).code == 200
    assert conn.call(["stats", "no-such-topic"]).code in (404, 500)
    conn.sock.sendall(b"quit\r\nversion 5\r\n")  # nothing after quit is read
    assert conn.sock.recv(100) == b""


def test_unknown_topics_and_partitions_and_closed_partitions(broker, conn):
    assert get(conn, "nope", 0, 0).code == 404
    assert get(conn, TOPIC, 7, 0).code == 404
    assert conn.call(["offset", "nope", "g", 0, 0]).code == 404
    assert put(conn, "nope", 0, b"x").code == 500
    broker.handler.close_partitions(ANONYMOUS, TOPIC, 0, 0)
    reply = put(conn, TOPIC, 0, b"x")
    assert reply.code == 403 and "closed" in reply.text
    assert get(conn, TOPIC, 0, 0).code == 403
    assert put(conn, TOPIC, -1, b"x").text.split(" ")[1] == "1"  # -1 picks an open one


# -- malformed requests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("line,body,match", [
    (b"put orders 0 5 0 12 9", b"hello", "checksum 12 does not match"),
    (b"put orders 0 5 0 1 2 3 4 9", b"hello", "expected 6, 7 or 8 tokens"),
    (b"put orders x 5 0 -1 9", b"hello", "partition 'x' is not an integer"),
    (b"put orders 0 3 1 -1 9", b"abc", "flag bit 0 says the data starts with an attribute"),
    (b"put orders 0 5 0 BADKEY 9", b"hello", "transaction key 'BADKEY'"),
    (b"put orders 0 99999 0 -1 9", b"x" * 99999, "valueLen 99999 exceeds maxMessageSize 65536"),
    (b"get orders g 0 0 0 9", b"", "invalid max size:0"),
    (b"get orders g 0 zero 100 9", b"", "offset 'zero' is not an integer"),
    (b"get orders g 0 9", b"", "expected get topic group partition offset maxSize opaque"),
    (b"offset orders g 0 9", b"", "expected offset topic group partition offset opaque"),
    (b"PUT orders 0 5 0 -1 9", b"", "unknown command 'PUT'"),
    (b"transaction TX:s:1 s NOPE 9", b"", "unknown transaction type 'NOPE'"),
    (b"value 3 9", b"abc", "value is a reply, not a request"),
    (b"", b"", "blank command line"),
    (b"version 1 2 3", b"", "expected version [opaque]"),
    (b"x" * 5000, b"", "command line longer than 4096 bytes"),
])
def test_each_malformed_request_gets_400_naming_it_and_the_connection_stays_usable(conn, line, body, match):
    conn.sock.sendall(line + b"\r\n" + body)
    reply = conn.read_reply()
    assert reply.code == 400 and match in reply.text, reply.text
    last = line.rsplit(b" ", 1)[-1]
    assert reply.opaque == (int(last) if last.isdigit() and b" " in line else 2147483647)  # else MetaQ's default
    assert conn.version()  # still usable: the refused request's body was read past
    assert put(conn, TOPIC, 0, b"after").code == 200


def test_a_sync_gets_503_and_a_lost_length_closes_the_connection(conn):
    conn.sock.sendall(b"sync orders 0 3 0 77 -1 5\r\nabc")
    reply = conn.read_reply()
    assert reply.code == 503 and conn.version()
    conn.sock.sendall(b"put orders 0 many 0 -1 6\r\nabc")
    reply = conn.read_reply()
    assert reply.code == 400 and "closing" in reply.text
    assert conn.sock.recv(100) == b""


def test_a_huge_declared_length_is_refused_before_its_body_arrives(broker, conn):
    conn.sock.sendall(b"put orders 0 2000000000 0 -1 3\r\n")  # 2 GB declared, none sent
    reply = conn.read_reply()
    assert reply.code == 400 and "exceeds maxMessageSize" in reply.text and reply.opaque == 3


# -- transactions ---------------------------------------------------------------------------------------

def tx(conn, key, kind, *extra):
    return conn.call(["transaction", key, "session-1", kind, *extra])


def test_local_transactions_are_seen_only_once_committed(broker, conn):
    part = broker.store.partition(TOPIC, 1)
    assert tx(conn, "TX:session-1:1", "BEGIN").code == 200
    bit, data = message_data(b"in tx", None)
    reply = conn.call(["put", TOPIC, 1, len(data), 0, zlib.crc32(data) & 0x7FFFFFFF, "TX:session-1:1"], data)
    assert reply.code == 200, reply.text
    assert get(conn, TOPIC, 1, 0).code == 404  # open: readers are held before it
    assert part.last_stable_offset == 0
    assert tx(conn, "TX:session-1:1", "COMMIT_ONE_PHASE").code == 200
    messages, used = decode_messages(get(conn, TOPIC, 1, 0).body, 0)
    assert [m.value for m in messages] == [b"in tx"]

    assert tx(conn, "TX:session-1:2", "BEGIN").code == 200
    conn.call(["put", TOPIC, 1, 7, 0, -1, "TX:session-1:2"], b"aborted")
    assert tx(conn, "TX:session-1:2", "ROLLBACK").code == 200
    put(conn, TOPIC, 1, b"after")
    reply = get(conn, TOPIC, 1, used)  # the aborted message and its marker are passed over
    if reply.code == 301:
        reply = get(conn, TOPIC, 1, int(reply.text))
    assert [m.value for m in decode_messages(reply.body, 0)[0]] == [b"after"]


def test_xa_branches_prepare_recover_and_commit(broker, conn):
    key = "XID:1:" + b"global-1".hex() + ":01:rm-1"
    long_key = "XID:1:" + (b"g" * 64).hex() + ":" + (b"b" * 64).hex() + ":rm-1"  # longer than metaq's 255-byte xids
    for k in (key, long_key):
        assert conn.call(["transaction", k, "s", "BEGIN", 60, "rm-1"]).code == 200
        assert conn.call(["put", TOPIC, 0, 2, 0, -1, k], b"xa").code == 200
        assert conn.call(["transaction", k, "s", "END"]).code == 200
        assert conn.call(["transaction", k, "s", "PREPARE"]).code == 200
    recovered = conn.ok(["transaction", "null", "s", "RECOVER", "rm-1"])
    assert sorted(k for k in recovered.split("\r\n") if k) == sorted([key, long_key])
    assert conn.ok(["transaction", "null", "s", "RECOVER", "other-rm"]) == ""
    assert get(conn, TOPIC, 0, 0).code == 404
    assert conn.call(["transaction", key, "s", "COMMIT_TWO_PHASE"]).code == 200
    assert conn.call(["transaction", long_key, "s", "ROLLBACK"]).code == 200
    messages, _ = decode_messages(get(conn, TOPIC, 0, 0).body, 0)
    assert [m.value for m in messages] == [b"xa"]
    assert conn.call(["transaction", "TX:nope:1", "s", "COMMIT_TWO_PHASE"]).code == 500


# -- a consumer group through ZooKeeper -----------------------------------------------------------------

@pytest.fixture
def zk(zookeeper, zk_root):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


def test_a_group_consumes_with_byte_offsets_committed_in_zookeeper(cluster, zk, zk_root):
    cluster.start_broker(1, settings={"metaqPort": 0, "numPartitions": 2}, topics={TOPIC: {}})
    layout = MetaqZkLayout(zk_root)
    wait_until(lambda: zk.exists(layout.topic_pub_broker(TOPIC, 1)), what="MetaQ's topic entry")
    metaq = Cluster(zk, zk_root)
    from tests.metaq_client import Producer as MetaqProducer
    producer = MetaqProducer(metaq, TOPIC)
    sent = [producer.send(b"m%d" % i, (1, i % 2)) for i in range(20)]
    consumer = GroupConsumer(metaq, "readers", TOPIC, max_size=64)
    consumer.join()
    got = []
    wait_until(lambda: got.extend(consumer.poll()) or len(got) == 20, what="all 20 messages")
    assert sorted(m.value for _, m in got) == sorted(b"m%d" % i for i in range(20))
    assert {m.msg_id for _, m in got} == {s.msg_id for s in sent}
    consumer.commit()
    consumer.leave()
    # metaq's own consumer of the group resumes where MetaQ's left off (the offset bridge maps them)
    for n in (0, 1):
        data = zk.get(layout.group_offset("readers", TOPIC, f"1-{n}"))[0].decode()
        msg_id, position = (int(x) for x in data.rsplit("-", 1))
        assert position == sum(size(b"m%d" % i) for i in range(n, 20, 2))
    with cluster.client(Consumer, group="readers") as native:
        wait_until(lambda: native.committed(TOPIC) == {"1-0": 10, "1-1": 10}, what="metaq's form of the offsets")
    metaq.close()


# -- what an acknowledgement means: kill -9 ---------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_acknowledged_metaq_puts_survive_kill_9_at_their_positions(tmp_path, seed):
    """A MetaQ put is answered once its batch is fsynced (the topic's default group commit): a broker
    killed with -9 while puts stream in keeps every acknowledged message, at the position its answer gave,
    once; the stream goes on from the end after the restart."""
    import random
    import threading

    from metaq_broker.devtools.broker_process import BrokerProcess
    rng = random.Random(seed)
    broker = BrokerProcess(tmp_path / "b", 1, settings={"metaqPort": 0, "dataPort": -1},
                           topics={"t": {"numPartitions": 1}}).start()
    port = broker.metaq_port
    acked, stop = {}, threading.Event()

    def produce():
        conn = Connection("127.0.0.1", port)
        i = 0
        try:
            while not stop.is_set():
                batch = [b"v%d-" % (i + k) + b"x" * rng.randrange(0, 200) for k in range(rng.randrange(1, 50))]
                for v in batch:
                    conn.send(["put", "t", 0, len(v), 0, zlib.crc32(v) & 0x7FFFFFFF], v)
                for v in batch:
                    reply = conn.read_reply()
                    assert reply.code == 200, reply.text
                    acked[int(reply.text.split(" ")[2])] = v
                i += len(batch)
        except (ConnectionError, OSError):
            pass  # the kill
        finally:
            conn.sock.close()

    try:
        writer = threading.Thread(target=produce)
        writer.start()
        wait_until(lambda: len(acked) >= 300 + rng.randrange(0, 300), what="acknowledged puts")
        broker.kill()
        stop.set()
        writer.join(30)
        assert not writer.is_alive()
        broker.start()
        conn = Connection("127.0.0.1", broker.metaq_port)  # any free port again
        stored, position = {}, 0
        while True:
            reply = get(conn, "t", 0, position, max_size=4096)
            if reply.kind == "result":
                assert reply.code == 404, reply.text
                break
            messages, used = decode_messages(reply.body, position)
            stored.update((m.offset, m.value) for m in messages)
            position += used
        assert {p: stored.get(p) for p in acked} == acked  # every acknowledged message, where it was said
        assert len(set(stored.values())) == len(stored)  # none twice
        reply = put(conn, "t", 0, b"after the restart")
        assert int(reply.text.split(" ")[2]) == position  # the stream goes on from its end
        conn.sock.close()
    finally:
        broker.kill()


def test_hostile_bytes_never_take_the_listener_down(broker, conn):
    """Random bytes, lines cut anywhere, huge numbers: each connection gets refusals or is closed; the
    broker keeps serving the others and holds no connection of them afterwards."""
    import random
    rng = random.Random(7)
    pieces = [b"put orders 0 ", b"get orders g 0 ", b"offset ", b"transaction ", b"stats ", b"\r\n", b" ", b"-1 ",
              b"99999999999999999999 ", b"\xff\xfe", b"TX:a:b ", b"XID:1:zz:00:q ", b"value 5 1\r\n", b"quit"]
    for _ in range(30):
        hostile = socket.create_connection(("127.0.0.1", broker.metaq_port), timeout=10)
        junk = b"".join(rng.choice(pieces) if rng.random() < 0.7 else rng.randbytes(rng.randrange(1, 64))
                        for _ in range(rng.randrange(1, 60)))
        try:
            hostile.sendall(junk)
            hostile.shutdown(socket.SHUT_WR)
            while hostile.recv(1 << 16):
                pass
        except OSError:
            pass
        hostile.close()
        assert conn.version()
    wait_until(lambda: broker.metaq_server.listener.connections() == 1, what="the hostile connections gone")


def test_a_log_of_the_previous_metaq_is_served_in_metaq_byte_positions(tmp_path):
    """Version 2 batches (no byte_base: they lie where the batch before ends, the first at 3 x its
    segment's start) are read at the positions metaq_positions gives them, and new puts continue."""
    from test_store_producers import _write_v2_log
    _write_v2_log(tmp_path / "data" / "old-0", [[b"old-a", b"old-b"], [b"old-c"], [b"x" * 50]])
    ini = tmp_path / "broker.ini"
    ini.write_text("[topic=old]\nnumPartitions=1\n")
    b = Broker(load(str(ini), {"brokerId": "1", "serverPort": "0", "zk.connect": "none", "kafkaPort": "0", "metaqPort": "0",
                               "dataPath": str(tmp_path / "data")})).start()
    try:
        conn = Connection("127.0.0.1", b.metaq_port)
        assert put(conn, "old", 0, b"new").text.split(" ")[2] == "145"
        messages, used = decode_messages(get(conn, "old", 0, 0).body, 0)
        assert [(m.offset, m.value) for m in messages] == [(0, b"old-a"), (25, b"old-b"), (50, b"old-c"),
                                                           (75, b"x" * 50), (145, b"new")]
        assert used == 145 + 23
        assert (get(conn, "old", 0, 30).code, get(conn, "old", 0, 30).text) == (301, "25")
        messages, _ = decode_messages(get(conn, "old", 0, 75, max_size=200).body, 75)
        assert [m.value for m in messages] == [b"x" * 50, b"new"]
        conn.sock.close()
    finally:
        b.stop()


def read_all(conn, position: int) -> tuple:
    """({position: value} of every message from ``position`` on, following 301s as a MetaQ consumer does,
    the end position)."""
    stored = {}
    while True:
        reply = get(conn, TOPIC, 0, position, max_size=300)
        if reply.kind == "result":
            if reply.code == 301:
                assert int(reply.text) > position
                position = int(reply.text)
                continue
            assert reply.code == 404, reply.text
            return stored, position
        messages, used = decode_messages(reply.body, position)
        stored.update((m.offset, m.value) for m in messages)
        position += used


def test_a_failover_keeps_every_acknowledged_put_at_its_position(tmp_path):
    """A replicated group (acks: the master and its in-sync replica): MetaQ puts acknowledged by the master,
    the master killed with -9, the new master found in MetaQ's ``master`` node serves every one of them at
    the position its answer gave, and the stream goes on from there; a replica answers no MetaQ put."""
    from metaq_broker.devtools.group import BrokerGroup
    from metaq_broker.devtools.zookeeper import LocalZooKeeper
    from metaq_broker.zk.paths import ZkPaths
    import json
    with LocalZooKeeper(data_dir=tmp_path / "zk", tick_time_ms=500) as server:
        group = BrokerGroup(tmp_path / "g", 1, server.connect_string, "/meta", members=2,
                            settings={"metaqPort": 0, "minInSyncReplicas": 2}, topics={TOPIC: {}}).start()
        zk = group.zk
        layout = MetaqZkLayout("/meta")

        def port_of(replica_id):
            return json.loads(zk.get(ZkPaths("/meta").group_replica(1, replica_id))[0])["metaqPort"]

        try:
            first = group.wait_master()
            group.wait_in_sync([0, 1])
            wait_until(lambda: zk.exists(layout.broker_master(1)), what="MetaQ's master node")
            conn = Connection(*Cluster(zk, "/meta").address(1))
            acked, pending = {}, []

            def put_stored(conn, value):
                """A put refused with 'nothing was written' (the in-sync set short of 2 for a moment) is sent
                again once both members are in sync; any other answer than 200 fails the test."""
                reply = put(conn, TOPIC, 0, value)
                while reply.code == 500 and "nothing was written" in reply.text:
                    group.wait_in_sync([0, 1], timeout=60)
                    reply = put(conn, TOPIC, 0, value)
                assert reply.code == 200, reply.text
                return reply

            for i in range(0, 60, 6):
                values = [b"m%d" % k + b"." * k for k in range(i, i + 6)]
                for v in values:
                    conn.send(["put", TOPIC, 0, len(v), 0, -1], v)
                for v in values:
                    reply = conn.read_reply()
                    if reply.code == 500 and "nothing was written" in reply.text:  # a loaded machine: the
                        pending.append(v)  # replica fell out of the in-sync set a moment; sent again below
                        continue
                    assert reply.code == 200, reply.text
                    acked[int(reply.text.split(" ")[2])] = v
                for v in pending:
                    reply = put_stored(conn, v)
                    acked[int(reply.text.split(" ")[2])] = v
                pending.clear()
            conn.sock.close()
            replica = Connection("127.0.0.1", port_of(1 - first))
            reply = put(replica, TOPIC, 0, b"to a replica")
            assert reply.code == 500 and "not master" in reply.text
            replica.sock.close()

            group.members[first].kill()
            assert group.wait_master(other_than=first, timeout=30) == 1 - first
            wait_until(lambda: zk.exists(layout.broker_master(1)) and
                       Cluster(zk, "/meta").address(1)[1] == port_of(1 - first), timeout=30, what="the new master")
            conn = Connection(*Cluster(zk, "/meta").address(1))
            stored, position = read_all(conn, 0)  # masters' epoch markers are hidden: 301s past them
            assert stored == acked
            reply = put(conn, TOPIC, 0, b"alone")  # minInSyncReplicas 2: refused, nothing stored
            assert reply.code == 500 and "in-sync" in reply.text, reply.text
            group.members[first].start()
            group.wait_in_sync([0, 1], timeout=60)
            at = int(put_stored(conn, b"after").text.split(" ")[2])  # after the new master's epoch marker
            assert at > position and read_all(conn, position)[0] == {at: b"after"}
            conn.sock.close()
        finally:
            group.stop()


def test_a_remembered_position_the_log_no_longer_has_is_looked_up_again(broker, conn):
    """Reply ends are remembered (position -> offset) so that a consumer reading on costs no search; one
    that no longer holds (a log truncated and written again in a failover) must not skip messages."""
    positions = [int(put(conn, TOPIC, 0, b"0123456789").text.split(" ")[2]) for _ in range(10)]
    assert positions == [30 * i for i in range(10)]
    part = broker.store.partition(TOPIC, 0)
    broker.metaq_server.positions.remember(part, 45, 8)  # wrong: 45 lies inside the message at 30
    reply = get(conn, TOPIC, 0, 45)
    assert (reply.code, reply.text) == (301, "30")
    broker.metaq_server.positions.remember(part, 60, 1)  # wrong the other way: the message at 30 is offset 1
    messages, _ = decode_messages(get(conn, TOPIC, 0, 60).body, 60)
    assert [m.offset for m in messages] == positions[2:]


def test_a_request_that_trickles_in_is_cut_off_at_its_deadline(tmp_path):
    """A request must arrive whole within the broker's requestTimeout of its first byte, however slowly its
    bytes keep coming (a slow sender holds a thread): here 2 s, the connection closed soon after."""
    import time

    b = Broker(load(None, {"brokerId": "1", "serverPort": "0", "zk.connect": "none", "kafkaPort": "0", "metaqPort": "0",
                           "requestTimeout": "2000", "dataPath": str(tmp_path / "data")})).start()
    try:
        slow = socket.create_connection(("127.0.0.1", b.metaq_port), timeout=10)
        slow.sendall(b"version 1\r\nput t")  # one whole request, then one that never ends
        assert slow.recv(100).startswith(b"result 200")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 10:
            try:
                slow.sendall(b"x")  # a byte every 0.2 s: each read comes well within any per-read timeout
            except OSError:
                closed = True
                break
            slow.settimeout(0.2)
            try:
                if slow.recv(100) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
        assert closed and time.monotonic() - started < 6
        slow.close()
    finally:
        b.stop()
