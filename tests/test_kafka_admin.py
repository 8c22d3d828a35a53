"""Kafka's admin APIs about the broker and a topic's partitions, with real Kafka admin clients
(confluent-kafka, kafka-python) against real broker processes and a real ZooKeeper: DescribeConfigs of a
broker (its settings under metaq's and Kafka's names; secrets never in the answer's bytes; another broker's
id refused naming it; DescribeConfigs on the cluster under ACLs)."""
from __future__ import annotations

import json
import socket
import ssl

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource
from conftest import wait_until
from test_kafka_listener import _read_frame as _read

from metaq_broker.client.admin import Admin as MetaqAdmin
from metaq_broker.devtools.process import freeze
from metaq_broker.errors import UnknownTopicError
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.protocol import decode_response, encode_request
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.users import put_user
from test_cli import metaq
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
    """SASL_SSL with ACLs, zk.auth and a replication password: ops may DescribeConfigs on the cluster and
    alter topic t, bob may only describe topic t (and the cluster)."""
    for user in ("ops", "bob"):
        put_user(zk, cluster.zk_root, user, Credential.make(f"{user}-pw"))
    add_acls(zk, cluster.zk_root, [Acl("User:ops", "Allow", "DescribeConfigs", "cluster", "metaq-cluster"),
                                   Acl("User:ops", "Allow", "Alter", "topic", "t"),
                                   Acl("User:bob", "Allow", "Describe", "topic", "t"),
                                   Acl("User:bob", "Allow", "Describe", "cluster", "metaq-cluster")])
    b = cluster.start_broker(1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                                 "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                                 "authorizer": "acl", "replication.sasl.username": "replicator",
                                 "replication.sasl.password": SECRET, "zk.auth": f"digest:metaq:{ZK_SECRET}"},
                             topics={"t": {"numPartitions": 1}})
    return b, pki


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


# -- CreatePartitions ------------------------------------------------------------------------------------
def _grow(admin, topic: str, count: int, **kw):
    from confluent_kafka.admin import NewPartitions
    (_, fut), = admin.create_partitions([NewPartitions(topic, count)], **kw).items()
    return fut.result(20)


def test_create_partitions_grows_a_topic_and_keeps_its_numbers_across_a_restart(cluster):
    """confluent-kafka's create_partitions on a one-broker cluster: 2 -> 5, the new numbers 2..4 are the
    broker's partitions 1-2..1-4, written and read by Kafka clients and metaq's Consumer; validate_only,
    shrinking, the same count, manual assignments and unknown topics are refused naming the problem; after
    a restart (the INI still says numPartitions=2) the topic still has 5 and what was written is there."""
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    from metaq_broker.client import Consumer as MetaqConsumer
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 2}})
    wait_until(lambda: _partitions(b.bootstrap, "t") == 2, what="t in metadata")
    admin = AdminClient({"bootstrap.servers": b.bootstrap, **QUIET})
    _grow(admin, "t", 4, validate_only=True)
    assert _partitions(b.bootstrap, "t") == 2
    _grow(admin, "t", 5)
    wait_until(lambda: _partitions(b.bootstrap, "t") == 5, what="t grown to 5 partitions")
    for count, words in ((3, "has 5 partitions, more than the 3"), (5, "has 5 partitions already")):
        with pytest.raises(KafkaException, match=words) as e:
            _grow(admin, "t", count)
        assert e.value.args[0].code() == 37  # INVALID_PARTITIONS
    from confluent_kafka.admin import NewPartitions
    (_, fut), = admin.create_partitions([NewPartitions("t", 6, [[1]])]).items()
    with pytest.raises(KafkaException, match="manual assignments"):
        fut.result(20)
    with pytest.raises(KafkaException) as e:
        _grow(admin, "no-such-topic", 3)
    assert e.value.args[0].code() == 3  # UNKNOWN_TOPIC_OR_PARTITION

    p = Producer({"bootstrap.servers": b.bootstrap, **QUIET})
    for n in range(5):
        p.produce("t", b"to-%d" % n, partition=n)
    assert p.flush(30) == 0

    def read_all(bootstrap) -> dict:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "x", "enable.auto.commit": False, **QUIET})
        c.assign([TopicPartition("t", n, 0) for n in range(5)])
        got = {}
        try:
            def poll():
                m = c.poll(0.3)
                if m is not None and m.error() is None:
                    got[m.partition()] = m.value()
                return len(got) == 5
            wait_until(poll, timeout=30, what="a message from each of the 5 partitions")
        finally:
            c.close()
        return got
    assert read_all(b.bootstrap) == {n: b"to-%d" % n for n in range(5)}
    with cluster.client(MetaqConsumer) as metaq:
        assert [bytes(v) for v in metaq.fetch("t", "1-4", 0).batch.column("value").to_pylist()] == [b"to-4"]
    b.stop()
    b = cluster.start_broker(1, topics={"t": {"numPartitions": 2}})  # an operator restarts with the old INI
    wait_until(lambda: _partitions(b.bootstrap, "t") == 5, what="t with 5 partitions after the restart")
    assert read_all(b.bootstrap) == {n: b"to-%d" % n for n in range(5)}


def test_create_partitions_on_the_controller_that_lacks_the_topic_and_with_kafka_python(cluster):
    """Kafka's admin clients send CreatePartitions to the controller (the live broker with the lowest id):
    broker 1 lacks topic u (created on broker 2), so the new partitions are broker 1's, numbered after
    broker 2's. kafka-python's create_partitions then grows it again, on broker 1."""
    from kafka.admin import KafkaAdminClient
    from kafka.admin import NewPartitions as KNewPartitions
    b1 = cluster.start_broker(1)
    b2 = cluster.start_broker(2, topics={"u": {"numPartitions": 2}})
    wait_until(lambda: _partitions(b1.bootstrap, "u") == 2, what="u in metadata")
    _grow(AdminClient({"bootstrap.servers": b2.bootstrap, **QUIET}), "u", 3)
    wait_until(lambda: _partitions(b2.bootstrap, "u") == 3, what="u grown to 3")
    admin = KafkaAdminClient(bootstrap_servers=b1.bootstrap, request_timeout_ms=20000)
    try:
        admin.create_partitions({"u": KNewPartitions(total_count=5)})
    finally:
        admin.close()
    wait_until(lambda: _partitions(b2.bootstrap, "u") == 5, what="u grown to 5")
    md = AdminClient({"bootstrap.servers": b2.bootstrap, **QUIET}).list_topics("u", timeout=10)
    assert [md.topics["u"].partitions[n].leader for n in range(5)] == [2, 2, 1, 1, 1]


def test_create_partitions_needs_alter_on_the_topic(secured):
    b, pki = secured
    body = {"topics": [{"name": "t", "count": 2, "assignments": None}], "timeout_ms": 10000,
            "validate_only": False}
    wait_until(lambda: _partitions(b.bootstrap, "t", {
        "security.protocol": "SASL_SSL", "ssl.ca.location": pki.ca, "sasl.mechanism": "PLAIN",
        "sasl.username": "ops", "sasl.password": "ops-pw"}) == 1, what="t in metadata")
    with _logged_in(b, pki, "bob") as s:
        s.sendall(encode_request(37, 3, 1, "x", body))
        (r,) = decode_response(37, 3, _read(s))[1]["results"]
        assert r["error_code"] == codes.TOPIC_AUTHORIZATION_FAILED, r
    with _logged_in(b, pki, "ops") as s:
        s.sendall(encode_request(37, 3, 1, "x", body))
        (r,) = decode_response(37, 3, _read(s))[1]["results"]
        assert r["error_code"] == codes.NONE, r


def test_a_grown_topic_of_a_replicated_group_survives_the_masters_kill(tmp_path, zookeeper, zk_root):
    """A group of two: CreatePartitions grows t on the master; the member grows as it copies, so an acks=all
    write to a new partition is acknowledged, and after the master's kill -9 the new master has the
    partitions and the message."""
    import os
    import signal

    from confluent_kafka import Consumer, Producer, TopicPartition

    from metaq_broker.devtools.group import BrokerGroup
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2,
                        topics={"t": {"numPartitions": 1}}).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(2))
        bootstrap = ",".join(m.bootstrap for m in group.members)
        quiet = {"log_level": 0}  # the killed member's connection errors are expected
        wait_until(lambda: _partitions(bootstrap, "t", quiet) == 1, what="t in metadata")
        _grow(AdminClient({"bootstrap.servers": bootstrap, **quiet}), "t", 3)
        wait_until(lambda: _partitions(bootstrap, "t", quiet) == 3, what="t grown to 3")
        # an operator's mistake: asking the member that is not the master (it grows only as it copies)
        other = group.members[1 - first]
        with socket.create_connection(("127.0.0.1", other.kafka_port), timeout=15) as s:
            s.sendall(encode_request(37, 3, 1, "x", {"topics": [{"name": "t", "count": 4, "assignments": None}],
                                                     "timeout_ms": 10000, "validate_only": False}))
            (r,) = decode_response(37, 3, _read(s))[1]["results"]
        assert r["error_code"] in (codes.NOT_LEADER_OR_FOLLOWER, codes.LEADER_NOT_AVAILABLE), r
        assert _partitions(bootstrap, "t", quiet) == 3
        p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 30000, **quiet})
        errors = []
        p.produce("t", b"in-2", partition=2, on_delivery=lambda e, m: errors.append(e) if e else None)
        assert p.flush(40) == 0 and errors == []
        os.kill(group.members[first].proc.pid, signal.SIGKILL)
        master = group.members[group.wait_master(timeout=30, other_than=first)]
        c = Consumer({"bootstrap.servers": master.bootstrap, "group.id": "x", "enable.auto.commit": False, **quiet})
        c.assign([TopicPartition("t", 2, 0)])
        try:
            m = wait_until(lambda: (lambda m: m if m is not None and m.error() is None else None)(c.poll(0.5)),
                           timeout=60, what="the message in the new partition from the new master")
            assert m.value() == b"in-2"
        finally:
            c.close()
    finally:
        group.stop()


# -- DeleteTopics ----------------------------------------------------------------------------------------
def _create_on(port: int, topic: str, partitions: int) -> None:
    """CreateTopics sent to one broker: the topic's partitions are that broker's."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(encode_request(19, 5, 1, "x", {"topics": [
            {"name": topic, "num_partitions": partitions, "replication_factor": -1, "assignments": [],
             "configs": []}], "timeout_ms": 10000, "validate_only": False}))
        (r,) = decode_response(19, 5, _read(s))[1]["topics"]
    assert r["error_code"] == codes.NONE, r


def _delete_raw(port: int, topics: list, version: int = 6, timeout_ms: int = 30000) -> list:
    """DeleteTopics over a raw connection (by name; (None, id) pairs by id): the answer's entries."""
    body = {"topics": [{"name": t, "topic_id": bytes(16)} if isinstance(t, str) else {"name": None, "topic_id": t[1]}
                       for t in topics], "timeout_ms": timeout_ms} if version >= 6 else \
        {"topic_names": topics, "timeout_ms": timeout_ms}
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_ms / 1000 + 15) as s:
        s.sendall(encode_request(20, version, 1, "x", body))
        return decode_response(20, version, _read(s))[1]["responses"]


def _dirs(data, topic: str) -> list:
    return sorted(p.name for p in data.iterdir() if p.name.startswith(f"{topic}-"))


def test_delete_topics_on_every_broker_then_create_again(cluster, zk):  # noqa: F811 - zk: the fixture
    """A topic with partitions on two brokers, written and with a group's committed offsets, deleted with
    confluent-kafka's AdminClient: gone from Metadata, from both data directories and from ZooKeeper (partition
    map, group offsets, the deletion record); a producer of it is told the topic is unknown. Created again it
    is empty, from offset 0, under a new topic id, and kafka-python deletes it again. Unknown topics, a topic
    of a broker's server.ini (which would come back at its restart) and a topic id no topic has are refused
    naming the problem."""
    from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import UnknownTopicOrPartitionError
    b1 = cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    b2 = cluster.start_broker(2)
    _create_on(b1.kafka_port, "gone", 2)
    _create_on(b2.kafka_port, "gone", 1)
    bootstrap = f"{b1.bootstrap},{b2.bootstrap}"
    wait_until(lambda: _partitions(bootstrap, "gone") == 3, what="gone's 3 partitions in Metadata")
    p = Producer({"bootstrap.servers": bootstrap, **QUIET})
    for n in range(3):
        p.produce("gone", b"m%d" % n, partition=n)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "g", **QUIET})
    c.commit(offsets=[TopicPartition("gone", n, 1) for n in range(3)], asynchronous=False)
    c.close()
    paths = ZkPaths(cluster.zk_root)
    assert zk.get_children(paths.group_offsets("g", "gone"))
    old_map = zk.get(paths.kafka_topic("gone"))[0]
    with cluster.client(MetaqAdmin) as metaq_admin:  # an operator closed a partition (MetaQ's closePartitions)
        metaq_admin.close_partitions("gone", 1, 0, 0)

    admin = AdminClient({"bootstrap.servers": bootstrap, **QUIET})
    assert admin.delete_topics(["gone"], operation_timeout=30)["gone"].result(45) is None
    assert _partitions(bootstrap, "gone") == 0
    for b in (b1, b2):
        assert _dirs(b.workdir / "data", "gone") == []
        assert "[topic=gone]" not in (b.workdir / "data" / "runtime-topics.ini").read_text()
    for path in (paths.kafka_topic("gone"), paths.topic("gone"), paths.group_offsets("g", "gone"),
                 paths.topic_deletion("gone")):
        assert zk.exists(path) is None, path
    errors = []
    p = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 3000, **QUIET})
    p.produce("gone", b"late", partition=0, on_delivery=lambda e, m: errors.append(e))
    p.flush(15)
    assert [e.code() for e in errors] in ([KafkaError.UNKNOWN_TOPIC_OR_PART], [KafkaError._UNKNOWN_TOPIC],
                                          [KafkaError._MSG_TIMED_OUT]), errors
    with socket.create_connection(("127.0.0.1", b1.kafka_port), timeout=15) as s:  # a consumer's ListOffsets
        s.sendall(encode_request(2, 5, 1, "x", {"replica_id": -1, "isolation_level": 0, "topics": [
            {"name": "gone", "partitions": [{"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}]}]}))
        (t,) = decode_response(2, 5, _read(s))[1]["topics"]
    assert t["partitions"][0]["error_code"] == codes.UNKNOWN_TOPIC_OR_PARTITION

    kadmin = KafkaAdminClient(bootstrap_servers=b2.bootstrap, request_timeout_ms=30000)
    try:
        kadmin.create_topics([NewTopic("gone", 2, 1)])
        wait_until(lambda: _partitions(bootstrap, "gone") == 2, what="gone created again")
        assert json.loads(zk.get(paths.kafka_topic("gone"))[0]) == {  # on the controller, broker 1
            "version": 1, "topicId": json.loads(zk.get(paths.kafka_topic("gone"))[0])["topicId"],
            "partitions": ["1-0", "1-1"]}
        assert json.loads(zk.get(paths.kafka_topic("gone"))[0])["topicId"] != json.loads(old_map)["topicId"]
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "g", **QUIET})
        try:
            assert [c.get_watermark_offsets(TopicPartition("gone", n), timeout=15) for n in (0, 1)] == [(0, 0)] * 2
            assert all(tp.offset < 0 for tp in c.committed([TopicPartition("gone", 0)], timeout=15))
        finally:
            c.close()
        again = Producer({"bootstrap.servers": bootstrap, **QUIET})  # open: the closed partition was the old one's
        delivered = []
        again.produce("gone", b"new", partition=0, on_delivery=lambda e, m: delivered.append(e and e.code()))
        again.flush(30)
        assert delivered == [None], delivered
        kadmin.delete_topics(["gone"], timeout_ms=30000)
        assert _partitions(bootstrap, "gone") == 0 and _dirs(b1.workdir / "data", "gone") == []
        with pytest.raises(UnknownTopicOrPartitionError):
            kadmin.delete_topics(["never-was"], timeout_ms=5000)
    finally:
        kadmin.close()
    for version in (1, 5, 6):
        (r,) = _delete_raw(b2.kafka_port, ["t"], version)
        assert r["error_code"] == codes.INVALID_REQUEST or version < 5, r
        if version >= 5:
            assert "broker(s) 1" in r["error_message"] and "[topic=t]" in r["error_message"], r
    (r,) = _delete_raw(b1.kafka_port, ["t"])
    assert r["error_code"] == codes.INVALID_REQUEST and "broker 1's configuration file" in r["error_message"], r
    (r,) = _delete_raw(b1.kafka_port, [(None, b"\x07" * 16)])
    assert r["error_code"] == codes.UNKNOWN_TOPIC_ID, r
    assert _partitions(bootstrap, "t") == 1 and _dirs(b1.workdir / "data", "t") == ["t-0"]

    # metaq's own command line and Admin client
    assert metaq(cluster, "topics", "create", "gone", "--partitions", "1").returncode == 0
    wait_until(lambda: _partitions(bootstrap, "gone") == 2, what="gone on both brokers again")
    r = metaq(cluster, "topics", "delete", "gone")
    assert r.returncode == 0 and b"topic gone: deleted" in r.stdout, r
    assert _partitions(bootstrap, "gone") == 0 and all(_dirs(b.workdir / "data", "gone") == [] for b in (b1, b2))
    r = metaq(cluster, "topics", "delete", "t")
    assert r.returncode == 1 and b"[topic=t]" in r.stderr and b"broker 1" in r.stderr, r
    with cluster.client(MetaqAdmin) as admin, pytest.raises(UnknownTopicError, match="never-was"):
        admin.delete_topic("never-was")


def test_delete_topics_needs_delete_on_the_topic(secured, zk):  # noqa: F811 - zk: the fixture
    """bob may describe topic d but not delete it: TOPIC_AUTHORIZATION_FAILED and nothing is deleted; ops,
    with Delete on d, deletes it."""
    b, pki = secured
    add_acls(zk, b.settings["zk.root"], [Acl("User:ops", "Allow", "Create", "cluster", "metaq-cluster"),
                                         Acl("User:ops", "Allow", "Delete", "topic", "d"),
                                         Acl("User:bob", "Allow", "Describe", "topic", "d")])

    def create_as_ops() -> int:
        with _logged_in(b, pki, "ops") as s:
            s.sendall(encode_request(19, 5, 1, "x", {"topics": [
                {"name": "d", "num_partitions": 1, "replication_factor": -1, "assignments": [], "configs": []}],
                "timeout_ms": 10000, "validate_only": False}))
            return decode_response(19, 5, _read(s))[1]["topics"][0]["error_code"]

    # ACLs reach a running broker through its ZooKeeper watch, a moment after they are written (Kafka's
    # too): refused until then (a run's request came first), created once they are there
    created = wait_until(lambda: [c for c in [create_as_ops()] if c != codes.TOPIC_AUTHORIZATION_FAILED],
                         what="ops's Create ACL at the broker")
    assert created == [codes.NONE]
    body = {"topics": [{"name": "d", "topic_id": bytes(16)}], "timeout_ms": 20000}
    with _logged_in(b, pki, "bob") as s:
        s.sendall(encode_request(20, 6, 1, "x", body))
        (r,) = decode_response(20, 6, _read(s))[1]["responses"]
    assert r["error_code"] == codes.TOPIC_AUTHORIZATION_FAILED, r
    assert _dirs(b.workdir / "data", "d") == ["d-0"]
    with _logged_in(b, pki, "ops") as s:
        s.sendall(encode_request(20, 6, 1, "x", body))
        (r,) = decode_response(20, 6, _read(s))[1]["responses"]
    assert r["error_code"] == codes.NONE, r
    assert _dirs(b.workdir / "data", "d") == []


def test_a_deletion_cut_short_by_kill_9_is_finished_at_restart_one_waits_for_a_transaction(cluster, zk):  # noqa: F811
    """The state a kill -9 leaves in the middle of a deletion: the record in ZooKeeper, one partition renamed
    ``*.deleted``, the other still there. The restarted broker removes the renamed one without opening it,
    deletes the rest, finishes the deletion and logs no error; other topics keep their messages. Then a
    topic with an open metaq transaction: its deletion waits (REQUEST_TIMED_OUT, puts refused as "being
    deleted") until the transaction ends, and is done after its rollback."""
    import os
    import signal

    from confluent_kafka import Producer
    b = cluster.start_broker(1)
    for topic in ("gone", "kept"):
        _create_on(b.kafka_port, topic, 2)
    wait_until(lambda: _partitions(b.bootstrap, "gone") == 2 and _partitions(b.bootstrap, "kept") == 2,
               what="both topics in Metadata")
    p = Producer({"bootstrap.servers": b.bootstrap, **QUIET})
    for topic in ("gone", "kept"):
        p.produce(topic, b"x", partition=1)
    assert p.flush(30) == 0
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(10)
    data = b.workdir / "data"
    os.rename(data / "gone-0", data / "gone-0.deleted")
    paths = ZkPaths(cluster.zk_root)
    zk.create(paths.topic_deletion("gone"), b"{}", makepath=True)
    b = cluster.start_broker(1)
    wait_until(lambda: zk.exists(paths.topic_deletion("gone")) is None, timeout=30, what="the deletion done")
    assert os.listdir(data) and _dirs(data, "gone") == [] and _dirs(data, "kept") == ["kept-0", "kept-1"]
    assert _partitions(b.bootstrap, "gone") == 0 and zk.exists(paths.kafka_topic("gone")) is None
    log = b.log_path.read_text()
    assert "Traceback" not in log and " ERROR " not in log, b.log_tail(40)
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "x", **QUIET})
    try:
        assert c.get_watermark_offsets(TopicPartition("kept", 1), timeout=15) == (0, 1)
    finally:
        c.close()

    # a metaq transaction with batches in the topic: the deletion waits for it, puts are refused meanwhile
    from metaq_broker.client import Producer as MetaqProducer
    mp = cluster.client(MetaqProducer)
    try:
        tx = mp.transaction("sink-a/1")
        tx.send_batch("kept", [b"open"], partition="1-0")
        (r,) = _delete_raw(b.kafka_port, ["kept"], timeout_ms=1500)
        assert r["error_code"] == codes.REQUEST_TIMED_OUT and "goes on" in r["error_message"], r
        assert _dirs(data, "kept") == ["kept-0", "kept-1"]
        with pytest.raises(UnknownTopicError, match="being deleted"):
            mp.send_batch("kept", [b"refused"], partition="1-1")
        tx.rollback()
    finally:
        mp.close()
    wait_until(lambda: _dirs(data, "kept") == [] and zk.exists(paths.topic_deletion("kept")) is None, timeout=30,
               what="the deletion done once the transaction ended")
    assert "its deletion on broker 1 waits: 1 transaction(s)" in b.log_path.read_text()


def test_create_partitions_raced_or_repeated_grows_once(broker):
    """Two clients ask at once for t (2 partitions) to have 4: the broker grows it once, to 4 (a count, not
    an increment); each answer is success or a retriable one, never a topic of 6."""
    import threading
    body = {"topics": [{"name": "t", "count": 4, "assignments": None}], "timeout_ms": 10000,
            "validate_only": False}
    codes_seen = []

    def ask():
        with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=15) as s:
            s.sendall(encode_request(37, 3, 1, "x", body))
            codes_seen.append(decode_response(37, 3, _read(s))[1]["results"][0]["error_code"])
    threads = [threading.Thread(target=ask) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert codes.NONE in codes_seen and set(codes_seen) <= {codes.NONE, codes.LEADER_NOT_AVAILABLE,
                                                            codes.INVALID_PARTITIONS}, codes_seen
    wait_until(lambda: _partitions(broker.bootstrap, "t") == 4, what="t with 4 partitions")
    admin = AdminClient({"bootstrap.servers": broker.bootstrap, **QUIET})
    (_, fut), = admin.describe_configs([ConfigResource("topic", "t")]).items()
    assert fut.result(15)["numPartitions"].value == "4"  # the broker's own count, not only Kafka's numbers
    with pytest.raises(Exception, match="has 4 partitions already"):
        _grow(admin, "t", 4)
    # an attacker's count: refused by TopicConfig's bounds on numPartitions before anything is opened
    with socket.create_connection(("127.0.0.1", broker.kafka_port), timeout=15) as s:
        s.sendall(encode_request(37, 3, 2, "x", {**body, "topics": [{"name": "t", "count": 2 ** 31 - 1,
                                                                     "assignments": None}]}))
        (r,) = decode_response(37, 3, _read(s))[1]["results"]
    assert r["error_code"] == codes.INVALID_CONFIG and "between 1 and 10000" in r["error_message"], r
    (_, fut), = admin.describe_configs([ConfigResource("topic", "t")]).items()
    assert fut.result(15)["numPartitions"].value == "4"


def test_a_replicated_group_deletes_on_every_member_when_the_master_is_killed(tmp_path, zookeeper, zk_root):
    """A group of three: topic gone written acks=all; DeleteTopics (timeout 0: answered once recorded) to the
    master, killed -9 right after. The two members left delete their copies, the new master finishes the
    deletion (no copy comes back from a member), and the killed member, restarted once the record is gone,
    deletes its copy too (the master has none and the group's entry is gone)."""
    import os
    import signal

    from confluent_kafka import Producer

    from metaq_broker.devtools.group import BrokerGroup
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                        topics={"kept": {"numPartitions": 1}}).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(3))
        master = group.members[first]
        _create_on(master.kafka_port, "gone", 2)
        bootstrap = ",".join(m.bootstrap for m in group.members)
        quiet = {"log_level": 0}  # the killed member's connection errors are expected
        wait_until(lambda: _partitions(bootstrap, "gone", quiet) == 2, what="gone in Metadata")
        p = Producer({"bootstrap.servers": bootstrap, "acks": "all", **quiet})
        for n in (0, 1):
            p.produce("gone", b"x", partition=n)
        assert p.flush(30) == 0
        wait_until(lambda: all(_dirs(m.workdir / "data", "gone") == ["gone-0", "gone-1"] for m in group.members),
                   what="gone copied to every member")
        (r,) = _delete_raw(master.kafka_port, ["gone"], timeout_ms=0)
        os.kill(master.proc.pid, signal.SIGKILL)
        master.proc.wait(10)
        assert r["error_code"] == codes.NONE, r
        group.wait_master(timeout=30, other_than=first)
        paths = group.paths
        wait_until(lambda: group.zk.exists(paths.topic_deletion("gone")) is None, timeout=60,
                   what="the deletion finished by the members left")
        others = [m for i, m in enumerate(group.members) if i != first]
        assert all(_dirs(m.workdir / "data", "gone") == [] for m in others)
        assert group.zk.exists(paths.kafka_topic("gone")) is None and group.zk.exists(paths.topic("gone")) is None
        assert _dirs(master.workdir / "data", "gone") == ["gone-0", "gone-1"]  # killed before it could
        master.start()
        wait_until(lambda: _dirs(master.workdir / "data", "gone") == [], timeout=60,
                   what="the restarted member's copy deleted")
        group.wait_in_sync(range(3), timeout=60)
        live = ",".join(m.bootstrap for m in group.members)
        assert _partitions(live, "gone", quiet) == 0 and _partitions(live, "kept", quiet) == 1
        assert all(_dirs(m.workdir / "data", "gone") == [] for m in group.members)

        # created again on the same master: acks=all waits for the replicas again (the old topic's high
        # watermark, 5, must not acknowledge the new one's first message while both replicas are frozen)
        master = group.members[group.wait_master()]
        _create_on(master.kafka_port, "again", 1)
        wait_until(lambda: _partitions(live, "again", quiet) == 1, what="again in Metadata")
        p = Producer({"bootstrap.servers": live, "acks": "all", **quiet})
        for _ in range(5):
            p.produce("again", b"old", partition=0)
        assert p.flush(30) == 0
        (r,) = _delete_raw(master.kafka_port, ["again"])
        assert r["error_code"] == codes.NONE, r
        _create_on(master.kafka_port, "again", 1)
        wait_until(lambda: _partitions(live, "again", quiet) == 1, what="again in Metadata again")
        group.wait_in_sync(range(3), timeout=60)
        frozen = [m for m in group.members if m is not master]
        delivered = []
        p = Producer({"bootstrap.servers": master.bootstrap, "acks": "all", **quiet})
        for m in frozen:
            freeze(m.proc.pid)
        try:
            p.produce("again", b"new", partition=0, on_delivery=lambda e, m: delivered.append(e))
            p.poll(1.5)
            assert delivered == [], "acknowledged by the deleted topic's high watermark"
        finally:
            for m in frozen:
                os.kill(m.proc.pid, signal.SIGCONT)
        assert p.flush(60) == 0 and delivered == [None], delivered
    finally:
        group.stop()
