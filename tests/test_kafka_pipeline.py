"""Pipelined Kafka requests on one connection (server/kafka_pipeline.py): Produce requests are appended as
they are read and answered once acknowledged, while the next ones are read; answers keep request order.
Adversaries: a client writing several Produce and Metadata frames before reading any answer; an acks=all
produce whose in-sync set shrinks while later requests wait behind it; a client gone with requests in
flight; librdkafka's idempotent producer with 5 requests in flight. Real broker processes, ZooKeeper,
confluent-kafka; raw frames over a socket where the order is the point."""
from __future__ import annotations

import os
import re
import signal
import socket
import struct
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Producer
from conftest import wait_until
from kafka_helpers import read_to_end
from test_kafka_listener import _read_frame

from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.process import freeze
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka import records as krecords
from metaq_broker.protocol.kafka.protocol import decode_response, encode_request

pytestmark = pytest.mark.process

QUIET = {"log_level": 3}
PRODUCE_V, METADATA_V, API_VERSIONS_V = 9, 12, 3


def _produce_frame(cid: int, topic: str, values: list, acks: int = -1, partition: int = 0) -> bytes:
    n = len(values)
    records = krecords.encode(np.arange(n), np.full(n, int(time.time() * 1000)), None, pa.array(values, pa.binary()),
                              None)
    body = {"transactional_id": None, "acks": acks, "timeout_ms": 30000,
            "topic_data": [{"name": topic, "partition_data": [{"index": partition, "records": bytes(records)}]}]}
    return encode_request(0, PRODUCE_V, cid, "pipeline-test", body)


def _metadata_frame(cid: int, topic: str) -> bytes:
    return encode_request(3, METADATA_V, cid, "pipeline-test", {
        "topics": [{"name": topic, "topic_id": bytes(16)}], "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False})


def _answers(s, expected: list) -> list:
    """The answers to ``expected`` [(api key, version)], read in order: (correlation id, body) each."""
    return [decode_response(key, version, _read_frame(s)) for key, version in expected]


def _partition_answer(body: dict) -> dict:
    return body["responses"][0]["partition_responses"][0]


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


@pytest.fixture
def broker(cluster):
    return cluster.start_broker(1, topics={"t": {"numPartitions": 1}})  # its Kafka port logged by then


def test_pipelined_produce_and_metadata_are_answered_in_request_order(broker):
    frames = [_produce_frame(1, "t", [b"a1", b"a2"]), _produce_frame(2, "t", [b"b1"], acks=1),
              _metadata_frame(3, "t"), _produce_frame(4, "t", [b"c1", b"c2", b"c3"]),
              _produce_frame(5, "t", [b"lost?"], partition=7),  # no such partition: its own error, in its place
              encode_request(18, API_VERSIONS_V, 6, "x", {"client_software_name": "x",
                                                          "client_software_version": "1"}),
              _produce_frame(7, "t", [b"d1"])]
    expected = [(0, PRODUCE_V), (0, PRODUCE_V), (3, METADATA_V), (0, PRODUCE_V), (0, PRODUCE_V),
                (18, API_VERSIONS_V), (0, PRODUCE_V)]
    with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=30) as s:
        s.sendall(b"".join(frames))  # every request before any answer is read
        answers = _answers(s, expected)
    assert [cid for cid, _ in answers] == [1, 2, 3, 4, 5, 6, 7]
    produced = {cid: _partition_answer(body) for cid, body in answers if cid in (1, 2, 4, 5, 7)}
    assert [produced[c]["error_code"] for c in (1, 2, 4, 7)] == [codes.NONE] * 4
    assert [produced[c]["base_offset"] for c in (1, 2, 4, 7)] == [0, 2, 3, 6]  # appended in request order
    assert produced[5]["error_code"] == codes.UNKNOWN_TOPIC_OR_PARTITION
    meta = answers[2][1]
    assert [t["name"] for t in meta["topics"]] == ["t"] and meta["topics"][0]["error_code"] == codes.NONE
    assert answers[5][1]["error_code"] == codes.NONE
    values = [v for _, _, _, v in sorted(read_to_end(broker.bootstrap, "t", **QUIET))]
    assert values == [b"a1", b"a2", b"b1", b"c1", b"c2", b"c3", b"d1"]


def _fsyncs(metrics_port: int, topic: str) -> float:
    """The broker's fsyncs that made appends of ``topic`` durable (metrics: metaq_fsyncs_total)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r'^metaq_fsyncs_total\{[^}]*topic="%s"[^}]*\} (\S+)$' % topic, text,
                                            re.M))


def test_pipelined_produce_requests_share_group_commits(cluster):
    """16 Produce requests written at once: the requests of one read are all appended before the
    answering thread's first fsync starts, which covers them all (2-3 fsyncs here; at most 8 wait at once,
    MAX_IN_FLIGHT). An answering thread that started on each request as soon as it was queued took one
    fsync per request (16 here): each fsync ran while the next request was being decoded."""
    b = cluster.start_broker(1, settings={"metricsPort": 0}, topics={"g": {"numPartitions": 1}})
    port = b.metrics_port
    before = _fsyncs(port, "g")
    with socket.create_connection(("127.0.0.1", b.kafka_port), timeout=60) as s:
        s.sendall(b"".join(_produce_frame(i, "g", [b"v%d" % i] * 1000) for i in range(1, 17)))
        answers = _answers(s, [(0, PRODUCE_V)] * 16)
    assert [cid for cid, _ in answers] == list(range(1, 17))
    assert [_partition_answer(body)["base_offset"] for _, body in answers] == list(range(0, 16000, 1000))
    used = _fsyncs(port, "g") - before
    assert 1 <= used <= 8, f"{used:.0f} fsyncs for 16 pipelined requests"


def _settled_threads(pid: int) -> int:
    """The broker's thread count once it stays the same for half a second."""
    seen = [_threads(pid)]

    def same() -> bool:
        time.sleep(0.5)
        seen.append(_threads(pid))
        return seen[-1] == seen[-2]
    wait_until(same, what="the broker's thread count settled")
    return seen[-1]


def test_a_client_gone_with_requests_in_flight_leaves_its_batches_stored_and_no_thread(broker):
    pid = broker.proc.pid
    with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=30) as s:  # the first connection:
        s.sendall(_produce_frame(1, "t", [b"first"]))  # the listener's warm-up (numba: a thread of its own) done
        assert _partition_answer(_answers(s, [(0, PRODUCE_V)])[0][1])["error_code"] == codes.NONE
    before = _settled_threads(pid)  # no Kafka connection left
    for round_ in range(3):
        s = socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=30)
        s.sendall(b"".join(_produce_frame(i, "t", [b"r%d-%d" % (round_, i)] * 50) for i in range(1, 21)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, answers unread
        s.close()
    want = {b"first"} | {b"r%d-%d" % (r, i) for r in range(3) for i in range(1, 21)}
    # Whatever was appended is acknowledged (visible) though nobody reads the answers; a reset may cut the
    # requests the broker had not read yet, so each round's batches are a prefix of what was sent, whole
    wait_until(lambda: _threads(pid) <= before, timeout=60, what="the connections' threads ended")
    seen = read_to_end(broker.bootstrap, "t", **QUIET)
    values = [v for _, _, _, v in sorted(seen)]
    assert set(values) <= want
    for r in range(3):
        mine = [int(v.split(b"-")[1]) for v in values if v.startswith(b"r%d-" % r)]
        assert len(mine) % 50 == 0 and sorted(set(mine)) == list(range(1, len(mine) // 50 + 1))
    with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=30) as s:  # the broker serves on
        s.sendall(_produce_frame(1, "t", [b"after"]))
        assert _partition_answer(_answers(s, [(0, PRODUCE_V)])[0][1])["error_code"] == codes.NONE


def test_an_idempotent_producer_with_five_in_flight_stores_each_message_once_in_order(broker):
    n = 30000
    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True, "acks": "all",
                  "max.in.flight.requests.per.connection": 5, "linger.ms": 1, "batch.num.messages": 200, **QUIET})
    failed = []
    for i in range(n):
        while True:
            try:
                p.produce("t", b"%06d" % i, key=b"k", on_delivery=lambda err, msg: failed.append(err) if err else None)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    assert p.flush(120) == 0
    assert failed == []  # no OutOfOrderSequence, no duplicate sequence, nothing refused
    seen = read_to_end(broker.bootstrap, "t", **QUIET)
    values = [v for _, _, _, v in sorted(seen)]
    assert values == [b"%06d" % i for i in range(n)]  # once each, in the order produced


def test_an_acks_all_produce_whose_in_sync_set_shrinks_is_answered_in_its_place(tmp_path, zookeeper, zk_root):
    """Three members, minInSyncReplicas 3; a replica frozen (SIGSTOP). Requests sent together: an acks=all
    produce (appended, then its in-sync set shrinks: not acknowledged, may or may not be stored), an acks=1
    produce behind it (acknowledged at once, but not answered before the first), a Metadata request, and
    after the shrink an acks=all produce refused before anything is written."""
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                        topics={"s": {"numPartitions": 1, "minInSyncReplicas": 3}}).start()
    stopped = None
    try:
        master = group.wait_master()
        group.wait_in_sync(range(3))
        m = group.members[master]
        stopped = group.members[(master + 1) % 3].proc.pid
        freeze(stopped)
        with socket.create_connection(("127.0.0.1", m.kafka_port), timeout=60) as s:
            s.sendall(b"".join([_produce_frame(1, "s", [b"all-1"]), _produce_frame(2, "s", [b"one-2"], acks=1),
                                _metadata_frame(3, "s")]))
            answers = _answers(s, [(0, PRODUCE_V), (0, PRODUCE_V), (3, METADATA_V)])
            assert [cid for cid, _ in answers] == [1, 2, 3]
            one, two = _partition_answer(answers[0][1]), _partition_answer(answers[1][1])
            assert one["error_code"] == codes.NOT_ENOUGH_REPLICAS_AFTER_APPEND
            assert "may or may not be stored" in one["error_message"] and "not master" not in one["error_message"]
            assert two["error_code"] == codes.NONE and two["base_offset"] >= 1  # appended after the first
            s.sendall(b"".join([_produce_frame(4, "s", [b"all-4"]), _produce_frame(5, "s", [b"one-5"], acks=1)]))
            later = _answers(s, [(0, PRODUCE_V), (0, PRODUCE_V)])
            assert [cid for cid, _ in later] == [4, 5]
            assert _partition_answer(later[0][1])["error_code"] == codes.NOT_ENOUGH_REPLICAS  # nothing written
            assert _partition_answer(later[1][1])["base_offset"] == two["base_offset"] + 1
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        group.stop()
