"""Fuzzing the data port of real broker processes (PLAINTEXT, and SASL_SSL with ACLs) with hypothesis:
frames of every kind with lengths, names and bodies that are valid, mutated or garbage, sent on a fresh
connection that then half-closes. Invariants: the broker answers in its reply layouts or closes, within
seconds (never hangs), never crashes, and stores nothing it refused (the partition's log end moves only
by the counts of the puts it acknowledged). A legitimate round trip works after the run."""
import socket
import ssl
import struct
import time

import pytest
from fuzzing import bodies, fuzz_settings, mutated
from hypothesis import given
from hypothesis import strategies as st

from metaq_broker.client import Consumer, Producer
from metaq_broker.client.connection import BrokerConnection
from metaq_broker.protocol import dataport, rawput
from metaq_broker.security.acl import Acl
from metaq_broker.security.settings import ClientSecurity

ANSWER_WITHIN_S = 15.0  # a half-closed connection is answered and closed by then, loaded machine included


@pytest.fixture(scope="module")
def brokers(tmp_path_factory, zookeeper, pki):
    """{"plain": ..., "sasl": ...}: (process, data port, client security, a session token for AUTH)."""
    from test_security import Brokers
    bs = Brokers.made(tmp_path_factory, zookeeper, "fuzz", users={"alice": "alice-pw"},
                      acls=[Acl("User:alice", "Allow", "All", "topic", "t")])
    topics = {"t": {"numPartitions": 1, "maxMessageSize": 1000}}
    plain = bs.start("plain", 1, {"maxFetchWait": 100}, topics=topics)
    sasl = bs.start("sasl", 2, {"maxFetchWait": 100, "security.protocol": "SASL_SSL", "authorizer": "acl",
                                "ssl.certificate.location": pki.broker.cert, "ssl.key.location": pki.broker.key,
                                "ssl.ca.location": pki.ca}, topics=topics)
    secure = ClientSecurity.from_properties({"security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
                                             "sasl.username": "alice", "sasl.password": "alice-pw"})
    conn = BrokerConnection(sasl.address, 10, secure)
    out = {name: (b, bs.data_port(b.broker_id), sec, conn.session_token() if sec else None, pki)
           for name, b, sec in (("plain", plain, None), ("sasl", sasl, secure))}
    yield bs, out
    conn.close()
    bs.stop()


def log_end(consumer, broker) -> int:
    return consumer.offsets("t")[f"{broker.broker_id}-0"][1]


def connect(port: int, pki, tls: bool):
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_S)
    if tls:
        s = ssl.create_default_context(cafile=pki.ca).wrap_socket(s, server_hostname="127.0.0.1")
    s.settimeout(ANSWER_WITHIN_S)
    return s


def exchange(port: int, pki, tls: bool, frames: bytes) -> bytes:
    """Send ``frames``, half-close, and read until the broker closes; AssertionError if it does not in time."""
    start = time.monotonic()
    with connect(port, pki, tls) as s:
        try:
            s.sendall(frames)
            socket.socket.shutdown(s, socket.SHUT_WR)  # also under TLS: no close_notify, just the end
        except OSError:
            pass  # closed on us already: a refusal of what came first
        got = bytearray()
        try:
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            raise AssertionError(f"the broker neither answered nor closed within {ANSWER_WITHIN_S}s "
                                 f"({len(got)} bytes so far)") from None
        except OSError:
            pass  # reset after a refusal
    assert time.monotonic() - start < ANSWER_WITHIN_S + 5
    return bytes(got)


def acknowledged(answer: bytes, sent: bytes) -> int:
    """Messages acknowledged in ``answer``: a run of put replies when ``sent`` starts with a PUT."""
    if len(sent) < dataport.PREFIX.size or dataport.PREFIX.unpack_from(sent)[1] != dataport.PUT:
        return 0
    n, pos = 0, 0
    while pos + dataport.PUT_REPLY.size <= len(answer):
        reply_len, status, *_, count, _, _ = dataport.PUT_REPLY.unpack_from(answer, pos)
        assert reply_len >= dataport.PUT_REPLY.size, f"a put reply of {reply_len} bytes"
        if status == dataport.OK:
            n += count
        pos += reply_len
    return n


def put_frame(body, topic: str = "t", xid: str = "") -> bytes:
    return b"".join(bytes(p) for p in dataport.put_request(
        rawput.pack_parts(topic, 0, xid, body.count, body.attributes, body.crc, body.parts)))


@st.composite
def frames(draw) -> bytes:
    kind = draw(st.sampled_from(["put", "mutated put", "fetch", "auth", "replica", "head", "garbage"]))
    if kind in ("put", "mutated put"):
        body = draw(bodies())
        frame = put_frame(body, draw(st.sampled_from(["t", "nope", "t" * 300])),
                          draw(st.sampled_from(["", "s/1/r/0"])))
        if kind == "mutated put":
            frame = draw(mutated(frame))
        return frame * draw(st.integers(1, 3))
    if kind == "fetch":
        frame = dataport.pack_request(draw(st.sampled_from(["t", "u", "nope", ""])), draw(st.integers(-2, 3)),
                                      draw(st.integers(-2, 50)), draw(st.integers(-1, 1 << 20)),
                                      draw(st.integers(-1, 100)), draw(st.integers(-1, 200)))
        return draw(mutated(frame)) if draw(st.booleans()) else frame
    if kind == "auth":
        return dataport.pack_auth(draw(st.text(max_size=64)))
    if kind == "replica":
        return draw(mutated(struct.pack("<IHH", 56, dataport.REPLICA_FETCH, 0) + bytes(48)))
    if kind == "head":
        head = dataport.REQUEST.pack(draw(st.integers(0, 2 ** 32 - 1)), draw(st.integers(0, 9)),
                                     draw(st.integers(0, 2 ** 16 - 1)), *draw(st.tuples(
                                         st.integers(-2 ** 31, 2 ** 31 - 1), st.integers(-2 ** 63, 2 ** 63 - 1),
                                         st.integers(-2 ** 31, 2 ** 31 - 1), st.integers(-2 ** 31, 2 ** 31 - 1),
                                         st.integers(-2 ** 31, 2 ** 31 - 1))))
        return head + draw(st.binary(max_size=128))
    return draw(st.binary(max_size=256))


@pytest.mark.parametrize("which", ["plain", "sasl"])
def test_hostile_frames_are_answered_or_closed_and_nothing_refused_is_stored(brokers, which):
    bs, by_name = brokers
    broker, port, sec, token, pki = by_name[which]
    consumer = Consumer(brokers=f"{broker.broker_id}={broker.address}", security=sec)
    before = [log_end(consumer, broker)]
    tried = [0]

    @fuzz_settings(short=150)
    @given(frames(), st.booleans())
    def one(frame, login_first):
        sent = dataport.pack_auth(token) + frame if sec is not None and login_first else frame
        answer = exchange(port, pki, sec is not None, sent)
        if sec is not None and login_first:
            answer = answer[dataport.REPLY.size + len(b"User:alice"):]
        if frame[4:6] == dataport.PREFIX.pack(0, dataport.PUT, 0)[4:6]:  # only a put can store anything
            stored = log_end(consumer, broker)
            assert stored - before[0] == acknowledged(answer, frame), "stored what was not acknowledged"
            before[0] = stored
        assert broker.proc.poll() is None, "the broker died"
        tried[0] += 1

    try:
        one()
    finally:
        consumer.close()
    print(f"{which}: {tried[0]} hostile frames")
    with Producer(brokers=f"{broker.broker_id}={broker.address}", security=sec) as p:  # still serves
        r = p.send_batch("t", [b"after the fuzz"], partition=f"{broker.broker_id}-0")[0]
    with Consumer(brokers=f"{broker.broker_id}={broker.address}", security=sec) as c:
        got = c.fetch("t", f"{broker.broker_id}-0", r.base_offset).batch.column("value").to_pylist()
    assert got == [b"after the fuzz"]
    log = broker.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback"):][:2000]
