"""The test MetaQ client (tests/metaq_client.py) against MetaQ's layout in a real ZooKeeper and, for
phase 1 only, ``FakeMetaqBroker``: a socket server made of metaq's MetaQ protocol parts (the parser, the
message-set encoder, the offset answers) over in-memory partitions. The broker's MetaQ listener (phase 2)
replaces the fake; these tests then run against real brokers unchanged but for the fixture.

What they prove now: the protocol parts work together over a socket with a client written from the
protocol description (producing in every put form, transactions, a group consuming by byte offsets,
301s past aborted transactions and markers, the maxSize doubling rule, committed ``<msgId>-<offset>``
offsets resumed by the next member)."""
import itertools
import random
import socket
import threading

import numpy as np
import pyarrow as pa
import pytest
from kazoo.client import KazooClient

from metaq_broker.protocol.metaq import text as T
from metaq_broker.protocol.metaq.messages import encode_message_set, message_sizes
from metaq_broker.protocol.metaq.offsets import Moved, NotFound, Window, answer_get, nearest_position
from metaq_broker.zk.metaq_layout import MetaqZkLayout, broker_uri, parse_group_offset, topic_entry
from tests.metaq_client import (Cluster, GroupConsumer, LocalTransaction, MetaqReplyError, Producer, XaBranch,
                                checksum)

TOPIC = "orders"


class FakeMetaqBroker:
    """Phase 1 stand-in for a broker's MetaQ listener: one batch per put, markers as hidden one-message
    batches, transactions held below the last stable offset until they settle."""

    def __init__(self, broker_id: int, num_partitions: int, max_message_size: int = 1 << 20):
        self.broker_id, self.max_message_size = broker_id, max_message_size
        self.parts = {n: [] for n in range(num_partitions)}  # n -> batches: dicts
        self.txns: dict = {}  # key -> {"state", "batches": [(n, batch)]}
        self.ids = itertools.count(1 << 40)
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def close(self):
        self.sock.close()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        parser = T.RequestParser(self.max_message_size)
        with conn:
            while not parser.closed:
                data = conn.recv(1 << 16)
                if not data:
                    return
                for event in (p for e in parser.feed(data) for p in (e.puts() if isinstance(e, T.PutRun) else [e])):
                    if isinstance(event, T.Quit):
                        return
                    with self.lock:
                        conn.sendall(self._answer(event))
                    if isinstance(event, T.Rejected) and event.close:
                        return

    # -- the log ---------------------------------------------------------------------------------------
    def _append(self, n, value, attribute, flag, hidden=False, txn=None):
        batches = self.parts[n]
        end = batches[-1]["byte_base"] + batches[-1]["size"] if batches else 0
        base = batches[-1]["base"] + 1 if batches else 0
        size = int(message_sizes([len(value)], [-1 if attribute is None else len(attribute.encode())])[0])
        b = dict(base=base, byte_base=end, size=size, value=value, attribute=attribute, flag=flag,
                 msg_id=next(self.ids), hidden=hidden, txn=txn)
        batches.append(b)
        return b

    def _window(self, n):
        bs = self.parts[n]
        aborted = lambda b: b["txn"] is not None and self.txns[b["txn"]]["state"] == "aborted"  # noqa: E731
        w = Window([b["base"] for b in bs], [b["byte_base"] for b in bs], [1] * len(bs), [b["size"] for b in bs],
                   [b["hidden"] or aborted(b) for b in bs])
        unsettled = [b["base"] for b in bs if b["txn"] is not None
                     and self.txns[b["txn"]]["state"] in ("open", "prepared")]
        lso = min(unsettled, default=len(bs))
        return w, lso, w.position_of(lso)

    # -- requests --------------------------------------------------------------------------------------
    def _answer(self, e) -> bytes:
        if isinstance(e, T.Rejected):
            return T.rejected_reply(e)
        if isinstance(e, T.Version):
            return T.result(200, "metaq-fake", e.opaque)
        if isinstance(e, T.Stats):
            return T.result(200, T.stats_body([("broker_id", self.broker_id)]), e.opaque)
        if isinstance(e, T.Put):
            n = random.randrange(len(self.parts)) if e.partition == -1 else e.partition
            if e.topic != TOPIC or n not in self.parts:
                return T.result(500, f"illegal topic or partition {e.topic}-{n}", e.opaque)
            txn = None
            if e.tx is not None:
                txn = str(e.tx)
                if self.txns.get(txn, {}).get("state") != "open":
                    return T.result(400, f"transaction {txn} is not open", e.opaque)
            b = self._append(n, e.value, e.attribute, e.flag, txn=txn)
            if txn:
                self.txns[txn]["batches"].append(n)
            return T.put_result(b["msg_id"], n, b["byte_base"], e.opaque)
        if isinstance(e, (T.Get, T.OffsetQuery)):
            if e.topic != TOPIC or e.partition not in self.parts:
                return T.result(404, f"The topic `{e.topic}` in partition `{e.partition}` is not exists", e.opaque)
            if not self.parts[e.partition]:
                return T.result(404, f"Could not find message at position {e.offset}", e.opaque)
            w, lso, end = self._window(e.partition)
            if isinstance(e, T.OffsetQuery):
                return T.result(200, str(nearest_position(w, e.offset, 0, lso, end)), e.opaque)
            a = answer_get(w, e.offset, e.max_size, 0, lso, end)
            if isinstance(a, Moved):
                return T.result(301, str(a.position), e.opaque)
            if isinstance(a, NotFound):
                return T.result(404, f"Could not find message at position {e.offset}", e.opaque)
            bs = self.parts[e.partition][a.offset: a.offset + max(a.count, 1)]
            data = encode_message_set(pa.array([b["value"] for b in bs], pa.binary()),
                                      pa.array([b["attribute"] for b in bs], pa.string()),
                                      np.array([b["flag"] for b in bs], np.int32),
                                      np.array([b["msg_id"] for b in bs], np.int64))
            data = bytes(data)[: a.nbytes]
            return T.value_header(len(data), e.opaque) + data
        if isinstance(e, T.Transaction):
            return self._transaction(e)
        raise AssertionError(f"unexpected event {e}")

    def _transaction(self, e):
        key = None if e.key is None else str(e.key)
        t = self.txns.get(key)
        if e.type == T.TxType.BEGIN:
            self.txns[key] = {"state": "open", "batches": [], "qualifier": e.unique_qualifier}
        elif e.type == T.TxType.RECOVER:
            prepared = [k for k, v in self.txns.items() if v["state"] == "prepared"
                        and v["qualifier"] == e.unique_qualifier]
            return T.result(200, "".join(k + "\r\n" for k in prepared), e.opaque)
        elif t is None:
            return T.result(400, f"unknown transaction {key}", e.opaque)
        elif e.type == T.TxType.END:
            pass
        elif e.type == T.TxType.PREPARE:
            t["state"] = "prepared"
        elif e.type in (T.TxType.COMMIT_ONE_PHASE, T.TxType.COMMIT_TWO_PHASE, T.TxType.ROLLBACK):
            t["state"] = "aborted" if e.type == T.TxType.ROLLBACK else "committed"
            for n in sorted(set(t["batches"])):
                self._append(n, b"\x01", None, 0, hidden=True)  # the marker: a hidden 21-byte message
        return T.result(200, None, e.opaque)


@pytest.fixture
def zk(zookeeper, zk_root):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(timeout=30)
    yield client
    client.delete(zk_root, recursive=True)
    client.stop()
    client.close()


@pytest.fixture
def brokers(zk, zk_root):
    """Two fake brokers (ids 1 and 2, two partitions each), registered in MetaQ's layout."""
    layout = MetaqZkLayout(zk_root)
    out = {}
    for broker_id in (1, 2):
        b = FakeMetaqBroker(broker_id, 2)
        zk.create(layout.broker_master(broker_id), broker_uri("127.0.0.1", b.port).encode(), ephemeral=True,
                  makepath=True)
        for path in (layout.topic_pub_broker(TOPIC, broker_id), layout.topic_sub_broker(TOPIC, broker_id)):
            zk.create(path, topic_entry(2, broker_id), makepath=True)
        out[broker_id] = b
    yield out
    for b in out.values():
        b.close()


@pytest.fixture
def cluster(zk, zk_root, brokers):
    c = Cluster(zk, zk_root)
    yield c
    c.close()


def drain(consumer, rounds=20):
    got = []
    for _ in range(rounds):
        batch = consumer.poll()
        if not batch:
            break
        got += batch
    return got


def test_produce_every_put_form_and_consume_through_a_group(cluster, zk, zk_root):
    assert cluster.partitions(TOPIC) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert cluster.connection(1).version() == "metaq-fake"
    sent = {}
    forms = [Producer(cluster, TOPIC), Producer(cluster, TOPIC, use_checksum=False),
             Producer(cluster, TOPIC, legacy=True)]
    for i in range(40):
        p = (1 + i % 2, i % 3 % 2)
        attribute = None if i % 4 else f"attr-{i}"
        r = forms[i % 3].send(b"v%03d" % i, p, attribute=attribute)
        sent.setdefault(r.partition, []).append((r.offset, b"v%03d" % i, attribute))
    consumer = GroupConsumer(cluster, "g", TOPIC, max_size=64)
    consumer.join()
    got = drain(consumer, rounds=100)
    by_part = {}
    for part, m in got:
        by_part.setdefault(part, []).append((m.offset, m.value, m.attribute))
    assert by_part == sent  # every message, in order, at the byte offset its put reported
    consumer.commit()
    node = f"{zk_root}/consumers/g/offsets/{TOPIC}/1-0"
    msg_id, offset = parse_group_offset(zk.get(node)[0])  # metaq's parser reads what the client wrote
    last = sent["1-0"][-1]
    assert offset == last[0] + 20 + len(last[1]) + (4 + len(last[2]) if last[2] else 0) and msg_id > 0


def test_a_new_member_resumes_from_committed_offsets_and_members_split_partitions(cluster):
    producer = Producer(cluster, TOPIC)
    for i in range(8):
        producer.send(b"first-%d" % i, (1 + i % 2, i // 2 % 2))
    a = GroupConsumer(cluster, "g2", TOPIC)
    a.join()
    assert len(drain(a)) == 8
    a.commit()
    a.leave()
    for i in range(8):
        producer.send(b"second-%d" % i, (1 + i % 2, i // 2 % 2))
    b, c = GroupConsumer(cluster, "g2", TOPIC), GroupConsumer(cluster, "g2", TOPIC)
    b.join()
    c.join()  # b still owns everything: c claims nothing yet
    assert c.owned == []
    b.rebalance()  # b lets go of c's share
    c.rebalance()
    assert sorted(b.owned + c.owned) == ["1-0", "1-1", "2-0", "2-1"] and len(b.owned) == len(c.owned) == 2
    values = sorted(m.value for _, m in drain(b) + drain(c))
    assert values == sorted(b"second-%d" % i for i in range(8))


def test_local_transactions_commit_and_rollback_and_readers_move_past_them(cluster):
    producer = Producer(cluster, TOPIC)
    producer.send(b"before", (1, 0))
    rolled = LocalTransaction(producer, 1)
    rolled.begin()
    rolled.send(b"aborted-1", 0)
    rolled.send(b"aborted-2", 0)
    committed = LocalTransaction(producer, 1)
    committed.begin()
    consumer = GroupConsumer(cluster, "gt", TOPIC)
    consumer.join()
    assert [m.value for _, m in drain(consumer)] == [b"before"]  # held at the open transaction
    rolled.rollback()
    committed.send(b"kept", 0, attribute="a")
    committed.commit()
    producer.send(b"after", (1, 0))
    assert [(m.value, m.attribute) for _, m in drain(consumer)] == [(b"kept", "a"), (b"after", None)]
    assert consumer.moves >= 2  # past the aborted batches and the markers


def test_xa_prepare_recover_commit(cluster):
    producer = Producer(cluster, TOPIC)
    branch = XaBranch(producer, 2, gtid=b"\x00global-1")
    branch.begin()
    branch.send(b"xa-1", 1)
    branch.end()
    branch.prepare()
    assert branch.recover() == [branch.key]
    consumer = GroupConsumer(cluster, "gx", TOPIC)
    consumer.join()
    assert drain(consumer) == []
    branch.commit()
    assert branch.recover() == []
    assert [m.value for _, m in drain(consumer)] == [b"xa-1"]


def test_max_size_doubles_for_a_large_message_and_shrinks_back(cluster):
    producer = Producer(cluster, TOPIC)
    producer.send(b"x" * 5000, (2, 0))
    producer.send(b"small", (2, 0))
    consumer = GroupConsumer(cluster, "gm", TOPIC, max_size=256)
    consumer.join()
    got = [m.value for _, m in drain(consumer)]
    assert got == [b"x" * 5000, b"small"]
    assert consumer.partials == 5  # 256 -> 512 -> ... -> 8192: five replies held no whole message
    assert consumer.sizes["2-0"] < 8192


def test_refusals_reach_the_client_and_the_connection_stays_usable(cluster):
    conn = cluster.connection(1)
    reply = conn.call(["put", TOPIC, 0, 5, 0, 1234], b"hello")
    assert reply.code == 400 and "checksum 1234 does not match" in reply.text
    reply = conn.call(["get", TOPIC, "g", 0, 0, 0])
    assert reply.code == 400 and "invalid max size:0" in reply.text
    assert conn.call(["get", TOPIC, "g", 7, 0, 100]).code == 404
    with pytest.raises(MetaqReplyError, match="400"):
        conn.ok(["transaction", "TX:s:1", "s", "COMMIT"])
    assert conn.ok(["put", TOPIC, 0, 5, 0, checksum(b"hello")], b"hello").split(" ")[1] == "0"
    assert conn.version() == "metaq-fake"


def test_pipelined_puts_are_answered_in_order(cluster):
    conn = cluster.connection(2)
    opaques = [conn.send(["put", TOPIC, 1, 3, 0, checksum(b"%03d" % i)], b"%03d" % i) for i in range(200)]
    replies = [conn.read_reply() for _ in opaques]
    assert [r.opaque for r in replies] == opaques and all(r.code == 200 for r in replies)
    offsets = [int(r.text.split(" ")[2]) for r in replies]
    assert offsets == [23 * i for i in range(200)]  # 20-byte header + 3 bytes each
