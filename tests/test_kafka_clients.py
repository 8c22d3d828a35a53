"""Real Kafka clients against our codec: confluent-kafka (librdkafka), kafka-python, aiokafka and Debian's
kcat produce to a capture server in this file, a socket that answers with metaq's Kafka codec only
(ApiVersions, Metadata pointing at itself, InitProducerId, Produce). Each client's requests must decode
(golden bytes from real clients, checked live), the record batches it produced (plain, keyed, headers, every
codec, idempotent) must decode to exactly what it sent, and it must accept our answers: its produce call
reports success with the offsets we assigned. No broker behind it: phase 2 wires the listener to one.
"""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import uuid
import warnings

import aiokafka
import confluent_kafka
import pytest

from metaq_broker.protocol.kafka import codes, records
from metaq_broker.protocol.kafka.framing import FrameSplitter
from metaq_broker.protocol.kafka.protocol import (KafkaRequestError, api_versions_response, encode_response,
                                                  error_response, read_request)

pytestmark = pytest.mark.process

with warnings.catch_warnings():  # kafka-python reads its schemas with importlib's deprecated text API
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka


PARTITIONS = 2
CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
CODE = {name: code for code, name in records.CODECS.items()}


class CaptureServer:
    """A one-node 'cluster' that speaks Kafka through metaq's codec and keeps what clients sent."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.1)  # the accept loop sees ``stopping`` within 0.1 s
        self.requests = []  # (api name, version, client id, body)
        self.produced = []  # (topic, partition, records.Batches)
        self.errors = []
        self.next_offset = {}
        self.lock = threading.Lock()
        self.conns = []
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        splitter = FrameSplitter()
        conn.settimeout(30)
        try:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    return
                for frame in splitter.feed(data):
                    try:
                        request = read_request(frame)
                    except KafkaRequestError as e:
                        self.errors.append(str(e))
                        if e.reply is None:
                            return
                        conn.sendall(b"".join(e.reply))
                        continue
                    body = self._answer(request)
                    if request.expects_response:
                        conn.sendall(b"".join(encode_response(request, body)))
        except OSError:
            return
        except Exception as e:  # a decode failure of our own is what these tests look for
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def _answer(self, request) -> dict:
        body = request.body
        with self.lock:
            self.requests.append((request.api.name, request.api_version, request.client_id, body))
        name = request.api.name
        if name == "ApiVersions":
            return api_versions_response(request)
        if name == "Metadata":
            wanted = [t["name"] for t in body["topics"]] if body["topics"] else ["captured"]
            return {"brokers": [{"node_id": 1, "host": "127.0.0.1", "port": self.port}], "cluster_id": "capture",
                    "controller_id": 1,
                    "topics": [{"name": t, "topic_id": uuid.uuid5(uuid.NAMESPACE_DNS, t).bytes,
                                "partitions": [{"partition_index": p, "leader_id": 1, "leader_epoch": 0,
                                                "replica_nodes": [1], "isr_nodes": [1]} for p in range(PARTITIONS)]}
                               for t in wanted]}
        if name == "InitProducerId":
            return {"producer_id": 4242, "producer_epoch": 0}
        if name == "Produce":
            responses = []
            for t in body["topic_data"]:
                parts = []
                for p in t["partition_data"]:
                    batches = records.decode(p["records"])
                    with self.lock:
                        self.produced.append((t["name"], p["index"], batches))
                        base = self.next_offset.get((t["name"], p["index"]), 0)
                        self.next_offset[(t["name"], p["index"])] = base + batches.records.num_rows
                    parts.append({"index": p["index"], "base_offset": base})
                responses.append({"name": t["name"], "partition_responses": parts})
            return {"responses": responses}
        return error_response(request, codes.UNSUPPORTED_VERSION, f"{name} is not answered by the capture server")

    def records(self, topic: str) -> list:
        """Every record produced to ``topic`` as (partition, key, value, headers), in arrival order."""
        out = []
        for t, p, b in self.produced:
            if t == topic:
                out += [(p, r["key"], r["value"], [(h["key"], h["value"]) for h in r["headers"]])
                        for r in b.records.to_pylist()]
        return out

    def batches(self, topic: str) -> list:
        return [b for t, _, b in self.produced if t == topic]

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def server():
    s = CaptureServer()
    yield s
    s.close()
    assert not s.errors, s.errors


def messages(n=20):
    return [(f"key-{i}".encode() if i % 3 else None, f"value {i} ".encode() * (i % 7 + 1),
             [("trace", f"t{i}".encode()), ("empty", b"")] if i % 2 else []) for i in range(n)]


def check_round_trip(server, topic, sent, keyed=True):
    got = server.records(topic)
    assert len(got) == len(sent)
    assert sorted(((k, v, h) for _, k, v, h in got), key=repr) == sorted(sent, key=repr)
    if keyed:  # a client hashes a key to one partition: each key's records share theirs
        where = {}
        for p, k, _, _ in got:
            if k is not None:
                assert where.setdefault(k, p) == p


def api_versions_seen(server) -> dict:
    return {name: v for name, v, _, _ in server.requests}


# ---------------------------------------------------------------------------------------------------
# confluent-kafka (librdkafka)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("idempotent", [False, True])
def test_confluent_kafka_produces(server, codec, idempotent):
    topic = f"ck-{codec}-{int(idempotent)}"
    p = confluent_kafka.Producer({"bootstrap.servers": server.bootstrap, "compression.type": codec,
                                  "enable.idempotence": idempotent, "acks": "all", "linger.ms": 5,
                                  "message.timeout.ms": 20000})
    sent, reports = messages(), []
    for k, v, h in sent:
        p.produce(topic, v, k, headers=h or None,
                  on_delivery=lambda err, msg: reports.append((err, msg.partition(), msg.offset())))
    assert p.flush(30) == 0
    assert len(reports) == len(sent) and all(err is None for err, _, _ in reports), reports
    check_round_trip(server, topic, sent)
    offsets = {}
    for _, part, off in reports:  # the offsets we answered, in order per partition
        offsets.setdefault(part, []).append(off)
    assert all(sorted(o) == list(range(len(o))) for o in offsets.values())
    batches = server.batches(topic)
    assert {int(c) for b in batches for c in b.codec} == {CODE[codec]}
    if idempotent:
        assert all((b.header["producer_id"] == 4242).all() and (b.header["base_sequence"] >= 0).all() for b in batches)
        assert any(name == "InitProducerId" for name, *_ in server.requests)
    else:
        assert all((b.header["producer_id"] == -1).all() for b in batches)
    seen = api_versions_seen(server)
    assert seen["ApiVersions"] >= 3 and seen["Produce"] >= 7 and seen["Metadata"] >= 4, seen


# ---------------------------------------------------------------------------------------------------
# kafka-python (pure Python; gzip is the codec it has without optional libraries)


@pytest.mark.parametrize("codec", [None, "gzip"])
def test_kafka_python_produces(server, codec):
    topic = f"kp-{codec}"
    p = kafka.KafkaProducer(bootstrap_servers=server.bootstrap, compression_type=codec, acks="all",
                            request_timeout_ms=20000)
    sent = messages()
    futures = [p.send(topic, value=v, key=k, headers=h) for k, v, h in sent]
    metas = [f.get(timeout=30) for f in futures]
    p.close(10)
    check_round_trip(server, topic, sent)
    assert all(m.offset >= 0 for m in metas)
    seen = api_versions_seen(server)
    assert seen["Produce"] >= 3, seen


# ---------------------------------------------------------------------------------------------------
# aiokafka (asyncio; its codecs come from cramjam)


@pytest.mark.parametrize("codec", [None, "gzip", "snappy", "lz4", "zstd"])
@pytest.mark.parametrize("idempotent", [False, True])
def test_aiokafka_produces(server, codec, idempotent):
    topic = f"aio-{codec}-{int(idempotent)}"
    sent = messages()

    async def run():
        p = aiokafka.AIOKafkaProducer(bootstrap_servers=server.bootstrap, compression_type=codec,
                                      enable_idempotence=idempotent, acks="all", request_timeout_ms=20000)
        await p.start()
        try:
            futs = [await p.send(topic, value=v, key=k, headers=h) for k, v, h in sent]
            return [await f for f in futs]
        finally:
            await p.stop()

    metas = asyncio.run(asyncio.wait_for(run(), 60))
    assert all(m.offset >= 0 for m in metas)
    check_round_trip(server, topic, sent)
    if idempotent:
        assert all((b.header["producer_id"] == 4242).all() for b in server.batches(topic))


# ---------------------------------------------------------------------------------------------------
# kcat (Debian's package, librdkafka underneath)


@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed (apt-get install kcat)")
@pytest.mark.parametrize("codec", CODECS)
def test_kcat_produces(server, codec):
    topic = f"kcat-{codec}"
    lines = [f"k{i}:line {i}" for i in range(10)] + [":no key"]
    args = ["kcat", "-P", "-b", server.bootstrap, "-t", topic, "-K", ":", "-H", "origin=kcat",
            "-X", f"compression.codec={codec}", "-X", "enable.idempotence=true"]
    run = subprocess.run(args, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "fail" not in run.stderr.lower() and "error" not in run.stderr.lower(), run.stderr
    got = server.records(topic)
    assert sorted(((k, v) for _, k, v, _ in got), key=repr) == sorted(
        ((line.split(":", 1)[0].encode(), line.split(":", 1)[1].encode()) for line in lines), key=repr)  # kcat: "" is an empty key
    assert all(h == [("origin", b"kcat")] for *_, h in got)
