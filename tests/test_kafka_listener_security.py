"""The Kafka listener under the broker's security: SASL_SSL with SCRAM-SHA-256 and PLAIN against metaq's
users (confluent-kafka over TLS with a throwaway CA), metaq's ACLs deciding every request with Kafka's
error codes, and what an attacker tries: requests before the login, a wrong password, a mechanism not
enabled. Real broker processes, a real ZooKeeper, real clients."""
from __future__ import annotations

import socket
import ssl

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from conftest import wait_until
from test_kafka_listener import _read_frame as _read

from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.protocol import decode_response, encode_request
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.users import put_user
from test_security_dataport import zk  # noqa: F401 - a fixture: a ZooKeeper client (pki: conftest)

pytestmark = pytest.mark.process

QUIET = {"log_level": 3}


@pytest.fixture
def secured(cluster, zk, pki):  # noqa: F811 - the fixtures imported above
    """A SASL_SSL broker with ACLs: alice may write, read and describe t and read group g; bob may only
    describe t."""
    put_user(zk, cluster.zk_root, "alice", Credential.make("alice-pw"))
    put_user(zk, cluster.zk_root, "bob", Credential.make("bob-pw"))
    add_acls(zk, cluster.zk_root, [Acl("User:alice", "Allow", "Write", "topic", "t"),
                                   Acl("User:alice", "Allow", "Read", "topic", "t"),
                                   Acl("User:alice", "Allow", "Read", "group", "g"),
                                   Acl("User:bob", "Allow", "Describe", "topic", "t")])
    b = cluster.start_broker(1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                                 "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                                 "authorizer": "acl"}, topics={"t": {"numPartitions": 2}})
    return b, pki


def client(b, pki, user, password, mechanism="SCRAM-SHA-256", **more) -> dict:
    return {"bootstrap.servers": b.bootstrap, "security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
            "sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": password, **QUIET, **more}


def test_sasl_ssl_scram_and_plain_produce_and_consume_in_a_group(secured):
    b, pki = secured
    conf = client(b, pki, "alice", "alice-pw")
    wait_until(lambda: len(AdminClient(conf).list_topics("t", timeout=5).topics["t"].partitions) == 2,
               what="t in metadata over SASL_SSL")
    for mechanism in ("SCRAM-SHA-256", "PLAIN"):
        p = Producer(client(b, pki, "alice", "alice-pw", mechanism, **{"enable.idempotence": True}))
        errors = []
        for i in range(20):
            p.produce("t", b"%s-%d" % (mechanism.encode(), i), on_delivery=lambda e, m: errors.append(e) if e else None)
        assert p.flush(30) == 0 and errors == []
    c = Consumer({**conf, "group.id": "g", "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe(["t"])
    got = set()

    def poll() -> bool:
        m = c.poll(0.3)
        if m is not None and m.error() is None:
            got.add(m.value())
        return len(got) == 40
    wait_until(poll, timeout=60, what="40 messages through the group")
    c.commit(asynchronous=False)
    c.close()


def test_acls_refuse_with_kafkas_error_codes(secured):
    b, pki = secured
    conf = client(b, pki, "bob", "bob-pw")
    wait_until(lambda: len(AdminClient(conf).list_topics("t", timeout=5).topics["t"].partitions) == 2,
               what="bob may describe t")
    p = Producer({**conf, "message.timeout.ms": 10000})
    failed = []
    p.produce("t", b"x", on_delivery=lambda e, m: failed.append(e))
    p.flush(20)
    assert [e.code() for e in failed] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    c = Consumer({**conf, "group.id": "g"})
    c.assign([TopicPartition("t", 0, 0)])
    errors = set()

    def poll() -> bool:
        m = c.poll(0.3)
        if m is not None:
            assert m.error() is not None, "bob read a message"
            errors.add(m.error().code())
        return KafkaError.TOPIC_AUTHORIZATION_FAILED in errors
    wait_until(poll, timeout=20, what="TOPIC_AUTHORIZATION_FAILED from the fetch")
    c.close()
    c = Consumer({**conf, "group.id": "g"})  # no Read on group g
    c.subscribe(["t"])
    m = wait_until(lambda: c.poll(0.5), timeout=20, what="an error from the group")
    assert m.error().code() == KafkaError.GROUP_AUTHORIZATION_FAILED
    c.close()
    # a topic alice may not describe is not shown to her, and refused when named
    md = AdminClient(client(b, pki, "alice", "alice-pw")).list_topics("other", timeout=10)
    assert md.topics["other"].error.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.UNKNOWN_TOPIC_OR_PART)


def test_wrong_password_and_unknown_user_fail_the_login(secured):
    b, pki = secured
    for user, password in (("alice", "wrong"), ("mallory", "x")):
        p = Producer({**client(b, pki, user, password), "message.timeout.ms": 5000})
        failed = []
        p.produce("t", b"x", on_delivery=lambda e, m: failed.append(e))
        p.flush(15)
        assert failed and failed[0].code() in (KafkaError._MSG_TIMED_OUT, KafkaError.SASL_AUTHENTICATION_FAILED,
                                               KafkaError._AUTHENTICATION)


def _tls_socket(b, pki):
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.check_hostname = False
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", b.kafka_port), timeout=10))


def test_requests_before_the_login_are_refused_and_the_connection_closed(secured):
    b, pki = secured
    with _tls_socket(b, pki) as s:  # ApiVersions is answered before the login, as Kafka does
        s.sendall(encode_request(18, 3, 1, "x", {"client_software_name": "x", "client_software_version": "1"}))
        assert decode_response(18, 3, _read(s))[1]["error_code"] == codes.NONE
        s.sendall(encode_request(3, 12, 2, "x", {"topics": None, "allow_auto_topic_creation": False}))
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            _read(s)
            _read(s)
    with _tls_socket(b, pki) as s:  # a mechanism the broker does not enable
        s.sendall(encode_request(17, 1, 1, "x", {"mechanism": "GSSAPI"}))
        answer = decode_response(17, 1, _read(s))[1]
        assert answer["error_code"] == codes.UNSUPPORTED_SASL_MECHANISM and "SCRAM-SHA-256" in answer["mechanisms"]
    with _tls_socket(b, pki) as s:  # PLAIN with a wrong password: answered, then closed
        s.sendall(encode_request(17, 1, 1, "x", {"mechanism": "PLAIN"}))
        assert decode_response(17, 1, _read(s))[1]["error_code"] == codes.NONE
        s.sendall(encode_request(36, 2, 2, "x", {"auth_bytes": b"\0alice\0nope"}))
        answer = decode_response(36, 2, _read(s))[1]
        assert answer["error_code"] == codes.SASL_AUTHENTICATION_FAILED and "authentication failed" in \
            answer["error_message"]
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            _read(s)
    with socket.create_connection(("127.0.0.1", b.kafka_port), timeout=10) as s:  # plain TCP on a TLS port
        s.sendall(encode_request(18, 3, 1, "x", {"client_software_name": "x", "client_software_version": "1"}))
        s.settimeout(10)
        try:
            data = s.recv(100)
        except ConnectionResetError:
            data = b""
        assert not data.startswith(b"\0\0")  # no Kafka answer without TLS
