"""Kafka's admin APIs about the broker and a topic's partitions, with real Kafka admin clients
(confluent-kafka, kafka-python) against real broker processes and a real ZooKeeper: DescribeConfigs of a
broker (its settings under metaq's and Kafka's names; secrets never in the answer's bytes; another broker's
id refused naming it; DescribeConfigs on the cluster under ACLs)."""
from __future__ import annotations

import socket
import ssl
import struct

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource
from conftest import wait_until

from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.protocol import decode_response, encode_request
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.users import put_user
from test_security_dataport import zk  # noqa: F401 - a fixture: a ZooKeeper client (pki: conftest)

pytestmark = pytest.mark.process

QUIET = {"log_level": 3}  # librdkafka: errors only
SECRET = "qx7-unlikely-Zeta"  # looks like nothing a redaction would know
ZK_SECRET = "wy3-zk-Omikron"


def _partitions(bootstrap: str, topic: str, conf=None) -> int:
    md = AdminClient({"bootstrap.servers": bootstrap, **QUIET, **(conf or {})}).list_topics(topic, timeout=5)
    t = md.topics.get(topic)
    return 0 if t is None or t.error is not None else len(t.partitions)


@pytest.fixture
def broker(cluster):
    b = cluster.start_broker(1, {"numPartitions": "3", "autoCreateTopics": "true", "maxSegmentSize": "1048576"},
                             topics={"t": {"numPartitions": 2}})
    wait_until(lambda: _partitions(b.bootstrap, "t") == 2, what="topic t in Kafka metadata")
    return b


def test_describe_broker_configs_with_confluent_kafka(broker):
    admin = AdminClient({"bootstrap.servers": broker.bootstrap, **QUIET})
    (_, fut), = admin.describe_configs([ConfigResource("broker", "1")]).items()  # ("": the raw test below)
    got = fut.result(15)
    configs = {k: v.value for k, v in got.items()}
    assert configs["numPartitions"] == configs["num.partitions"] == "3"
    assert configs["maxSegmentSize"] == configs["log.segment.bytes"] == "1048576"
    assert configs["autoCreateTopics"] == configs["auto.create.topics.enable"] == "true"
    assert configs["min.insync.replicas"] == "1" and configs["broker.id"] == "1"
    assert configs["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{broker.kafka_port}"
    assert configs["log.retention.ms"] == str(168 * 3_600_000)
    assert not got["num.partitions"].is_default and got["maxMessageSize"].is_default
    assert got["zk.auth"].is_sensitive and got["zk.auth"].value is None
    # another broker's id (librdkafka would send that to broker 2 itself: asked here over a raw connection)
    with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=15) as s:
        s.sendall(encode_request(32, 4, 1, "x", {"resources": [
            {"resource_type": 4, "resource_name": name, "configuration_keys": ["num.partitions"]}
            for name in ("2", "", "one")]}))
        other, own, bad = decode_response(32, 4, _read(s))[1]["results"]
    assert other["error_code"] == codes.INVALID_REQUEST and "broker '2'" in other["error_message"]
    assert other["configs"] == [] and bad["error_code"] == codes.INVALID_REQUEST
    assert own["error_code"] == codes.NONE and [(c["name"], c["value"]) for c in own["configs"]] == \
        [("num.partitions", "3")]


def test_describe_broker_configs_with_kafka_python(broker):
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=15000)
    try:
        every = admin.describe_configs([KConfigResource(ConfigResourceType.BROKER, "1")],
                                       config_filter="all")["broker"]["1"]
        assert every["num.partitions"]["value"] == "3" and every["log.segment.bytes"]["value"] == "1048576"
        assert every["zk.auth"]["value"] is None and every["zk.auth"]["is_sensitive"]
    finally:
        admin.close()


# -- secrets and ACLs -------------------------------------------------------------------------------------
@pytest.fixture
def secured(cluster, zk, pki):  # noqa: F811 - the fixture imported above
    """SASL_SSL with ACLs, zk.auth and a replication password: ops may DescribeConfigs on the cluster,
    bob may only describe topic t."""
    for user in ("ops", "bob"):
        put_user(zk, cluster.zk_root, user, Credential.make(f"{user}-pw"))
    add_acls(zk, cluster.zk_root, [Acl("User:ops", "Allow", "DescribeConfigs", "cluster", "metaq-cluster"),
                                   Acl("User:bob", "Allow", "Describe", "topic", "t"),
                                   Acl("User:bob", "Allow", "Describe", "cluster", "metaq-cluster")])
    b = cluster.start_broker(1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                                 "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                                 "authorizer": "acl", "replication.sasl.username": "replicator",
                                 "replication.sasl.password": SECRET, "zk.auth": f"digest:metaq:{ZK_SECRET}"},
                             topics={"t": {"numPartitions": 1}})
    return b, pki


def _read(s) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    n, out = struct.unpack(">i", head)[0], b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _logged_in(b, pki, user: str):
    """A TLS socket to the Kafka listener, logged in with SASL PLAIN as ``user``."""
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.check_hostname = False
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", b.kafka_port), timeout=15))
    s.sendall(encode_request(17, 1, 1, "x", {"mechanism": "PLAIN"}))
    assert decode_response(17, 1, _read(s))[1]["error_code"] == codes.NONE
    s.sendall(encode_request(36, 2, 2, "x", {"auth_bytes": b"\0%s\0%s-pw" % (user.encode(), user.encode())}))
    assert decode_response(36, 2, _read(s))[1]["error_code"] == codes.NONE
    return s


def test_broker_secrets_never_leave_and_describe_configs_needs_the_acl(secured):
    """An attacker's view: every byte of every DescribeConfigs answer (all keys, the secrets named, every
    version) is searched for the replication password and the zk.auth password; bob, without
    DescribeConfigs on the cluster, gets CLUSTER_AUTHORIZATION_FAILED and no settings."""
    b, pki = secured
    body = {"resources": [{"resource_type": 4, "resource_name": "1", "configuration_keys": None},
                          {"resource_type": 4, "resource_name": "",
                           "configuration_keys": ["replication.sasl.password", "zk.auth", "zk.client.auth"]}],
            "include_synonyms": True, "include_documentation": True}
    with _logged_in(b, pki, "ops") as s:
        for i, version in enumerate((1, 2, 3, 4)):
            s.sendall(encode_request(32, version, 10 + i, "x", body))
            raw = _read(s)
            assert SECRET.encode() not in raw and ZK_SECRET.encode() not in raw, version
            results = decode_response(32, version, raw)[1]["results"]
            assert [r["error_code"] for r in results] == [codes.NONE, codes.NONE], results
            every = {c["name"]: c for c in results[0]["configs"]}
            assert every["replication.sasl.username"]["value"] == "replicator"
            assert every["security.protocol"]["value"] == "SASL_SSL"
            assert every["advertised.listeners"]["value"] == f"SASL_SSL://127.0.0.1:{b.kafka_port}"
            secrets = {c["name"]: c for c in results[1]["configs"]}
            assert set(secrets) == {"replication.sasl.password", "zk.auth", "zk.client.auth"}
            for c in secrets.values():
                assert c["is_sensitive"] and c["value"] is None, c
            assert [secrets[k]["config_source"] for k in ("zk.auth", "zk.client.auth")] == [4, 5]  # set, not
    with _logged_in(b, pki, "bob") as s:
        s.sendall(encode_request(32, 4, 1, "x", body))
        results = decode_response(32, 4, _read(s))[1]["results"]
        assert [r["error_code"] for r in results] == [codes.CLUSTER_AUTHORIZATION_FAILED] * 2
        assert all(r["configs"] == [] for r in results)
        # a topic bob may describe is still described (Describe on the topic, as before)
        s.sendall(encode_request(32, 4, 2, "x", {"resources": [{"resource_type": 2, "resource_name": "t",
                                                                "configuration_keys": None}]}))
        (r,) = decode_response(32, 4, _read(s))[1]["results"]
        assert r["error_code"] == codes.NONE and {c["name"] for c in r["configs"]} >= {"numPartitions"}
    # through a real client too
    conf = {"bootstrap.servers": b.bootstrap, "security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca,
            "sasl.mechanism": "PLAIN", "sasl.username": "ops", "sasl.password": "ops-pw", **QUIET}
    admin = AdminClient(conf)
    (_, fut), = admin.describe_configs([ConfigResource("broker", "1")]).items()
    got = fut.result(20)
    assert got["replication.sasl.password"].is_sensitive and got["replication.sasl.password"].value is None
