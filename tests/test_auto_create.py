"""Topics created on first use by metaq's own producer (``autoCreateTopics``, issue 27), with real broker
processes and a real ZooKeeper: off by default and refused naming the key, on creates once on the live
broker with the lowest id with its numPartitions, under SASL only for a principal allowed Create, never for
an invalid name, never by a consumer or the Spark source."""
import threading

import pytest
from conftest import wait_until
from test_security import PASSWORDS, _brokers, sasl

from metaq_broker.client import Admin, Consumer, Producer
from metaq_broker.errors import AuthorizationError, UnknownTopicError
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import add_acls
from metaq_broker.zk.session import new_client
from metaq_broker.zk.users import put_user

AUTO = {"autoCreateTopics": "true", "numPartitions": 3}


def _registered(client, topic) -> list:
    return client.cluster.registered_partitions(topic)


def _read_all(consumer, topic) -> list:
    out = []
    for name in consumer.partitions(topic):
        out += consumer.fetch(topic, name, 0, max_messages=10_000).batch.column("value").to_pylist()
    return sorted(out)


def test_off_by_default_the_producer_is_refused_naming_the_key_and_nothing_is_created(cluster):
    cluster.start_broker(1, topics={"t": {"numPartitions": 1}})
    with cluster.client(Producer, timeout=10) as p:
        wait_until(lambda: p.cluster.topic_partitions("t"), what="t registered")
        for send in (lambda: p.send_batch("fresh", [b"x"]), lambda: p.send("fresh", b"x", key=b"k")):
            with pytest.raises(UnknownTopicError) as e:
                send()
            msg = str(e.value)
            assert "'fresh' is not" in msg and "autoCreateTopics=false" in msg and "metaq topics create fresh" in msg
        assert _registered(p, "fresh") == []
    with cluster.client(Admin) as admin:
        assert "fresh" not in admin.topics()


def test_on_the_first_send_creates_the_topic_on_the_lowest_live_broker_and_the_messages_are_stored(cluster):
    cluster.start_broker(2, AUTO)
    cluster.start_broker(1, AUTO)
    with cluster.client(Producer, timeout=15) as p:
        wait_until(lambda: len(p.cluster.brokers()) == 2, what="two brokers live")
        results = p.send_batch("fresh", [b"a", b"b"])
        assert sum(r.count for r in results) == 2
        assert _registered(p, "fresh") == [(1, 0), (1, 1), (1, 2)]  # broker 1's numPartitions, on it only
        p.send("keyed", b"k1", key=b"key").result(15)  # the asynchronous send, key hashed: the same path
        p.send_batch("fresh", [b"c"])  # known now: sent as to any topic
    with cluster.client(Consumer) as c:
        assert _read_all(c, "fresh") == [b"a", b"b", b"c"]
        assert _read_all(c, "keyed") == [b"k1"]


def test_only_the_broker_asked_decides_and_a_consumer_never_creates(cluster):
    cluster.start_broker(1)  # the lowest id, autoCreateTopics false: the producer asks it, and it refuses
    cluster.start_broker(2, AUTO)
    with cluster.client(Producer, timeout=10) as p:
        wait_until(lambda: len(p.cluster.brokers()) == 2, what="two brokers live")
        with pytest.raises(UnknownTopicError, match="broker 1 does not create topics on first use"):
            p.send_batch("fresh", [b"x"])
    with cluster.client(Consumer, group="g", timeout=5) as c:
        for read in (lambda: c.partitions("nowhere"), lambda: c.fetch("nowhere", "2-0", 0),
                     lambda: c.subscribe("nowhere")):
            with pytest.raises(UnknownTopicError):
                read()
        assert _registered(c, "nowhere") == [] and _registered(c, "fresh") == []


def test_a_topic_whose_broker_is_down_is_not_created_again_elsewhere(cluster):
    """An operator's broker is down (stopped): its topic stays registered, so the producer waits for it and
    then fails; it does not make a second topic of that name on the broker it would ask."""
    cluster.start_broker(1, AUTO)
    held = cluster.start_broker(2, topics={"held": {"numPartitions": 1}})
    with cluster.client(Producer, timeout=3) as p:
        wait_until(lambda: p.cluster.topic_partitions("held"), what="held registered")
        held.stop()
        wait_until(lambda: not p.cluster.topic_partitions("held"), what="broker 2 gone")
        with pytest.raises(UnknownTopicError, match="'held' is not on any live broker"):
            p.send_batch("held", [b"x"])
        assert _registered(p, "held") == [(2, 0)]
    with Admin(brokers=f"1={cluster.brokers[1].address}") as admin:
        assert "held" not in admin.topics()


def test_a_producer_with_a_static_broker_list_creates_too(cluster):
    cluster.start_broker(1, AUTO)
    with Producer(brokers=f"1={cluster.brokers[1].address}", timeout=10) as p:
        p.send_batch("listed", [b"s"])
        assert p.cluster.topic_partitions("listed") == [(1, 0), (1, 1), (1, 2)]
    with cluster.client(Consumer) as c:
        assert _read_all(c, "listed") == [b"s"]


def test_producers_racing_create_the_topic_once(cluster):
    cluster.start_broker(1, AUTO)
    cluster.start_broker(2, AUTO)
    producers = [cluster.client(Producer, timeout=20) for _ in range(6)]
    try:
        for p in producers:
            wait_until(lambda: len(p.cluster.brokers()) == 2, what="two brokers live")
        start, errors = threading.Barrier(len(producers)), []

        def run(i, p):
            try:
                start.wait(20)
                p.send_batch("raced", [b"p%d-%d" % (i, j) for j in range(5)])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert _registered(producers[0], "raced") == [(1, 0), (1, 1), (1, 2)]
    finally:
        for p in producers:
            p.close()
    with cluster.client(Consumer) as c:
        assert _read_all(c, "raced") == sorted(b"p%d-%d" % (i, j) for i in range(6) for j in range(5))


def test_an_invalid_name_is_refused_with_the_stores_error(cluster):
    cluster.start_broker(1, AUTO)
    with cluster.client(Producer, timeout=10) as p:
        wait_until(lambda: p.cluster.brokers(), what="broker live")
        with pytest.raises(ValueError, match="only letters, digits"):
            p.send_batch("bad name!", [b"x"])
        with pytest.raises(ValueError, match="limit is"):
            p.send_batch("x" * 300, [b"x"])
        assert _registered(p, "bad name!") == []


@pytest.fixture(scope="module")
def secured(tmp_path_factory, zookeeper, pki):
    bs = _brokers(tmp_path_factory, zookeeper, "auto")
    zk = new_client(zookeeper.connect_string)
    zk.start()
    for user, password in PASSWORDS.items():
        put_user(zk, bs.root, user, Credential.make(password))
    add_acls(zk, bs.root, [Acl("User:alice", "Allow", "Write", "topic", "auto-", "prefixed"),  # no Create
                           Acl("User:bob", "Allow", "All", "topic", "auto-", "prefixed")])
    broker = bs.start("b", 1, {"security.protocol": "SASL_SSL", "ssl.certificate.location": pki.broker.cert,
                               "ssl.key.location": pki.broker.key, "ssl.ca.location": pki.ca,
                               "authorizer": "acl", "super.users": "User:admin", **AUTO})
    yield bs, broker
    bs.stop()
    zk.stop()
    zk.close()


def test_under_sasl_only_a_principal_allowed_create_creates(secured, pki):
    bs, _ = secured
    with bs.client(Producer, sasl(pki, "alice"), use_data_port=False, timeout=10) as p:
        wait_until(lambda: p.cluster.brokers(), what="broker live")
        with pytest.raises(AuthorizationError, match="User:alice is not allowed Create"):
            p.send_batch("auto-alice", [b"x"])
        assert _registered(p, "auto-alice") == []
    with bs.client(Producer, sasl(pki, "bob"), use_data_port=False, timeout=10) as p:
        p.send_batch("auto-bob", [b"y"])
        assert _registered(p, "auto-bob") == [(1, 0), (1, 1), (1, 2)]
    with bs.client(Producer, sasl(pki, "alice"), use_data_port=False, timeout=10) as p:
        p.send_batch("auto-bob", [b"z"])  # it exists now: Write is all a producer needs
    with bs.client(Consumer, sasl(pki, "bob")) as c:
        assert _read_all(c, "auto-bob") == [b"y", b"z"]


def test_the_spark_source_does_not_create_topics(cluster, spark):
    """Subscribing to a topic no broker has reads nothing (as Kafka's source); assigning its partitions is
    an error naming it; neither creates it, also where the brokers would let a producer."""
    from spark_helpers import reader
    cluster.start_broker(1, AUTO)
    assert reader(spark, cluster, subscribe="nowhere").count() == 0
    with pytest.raises(Exception, match="no broker registered the topic"):  # noqa: B017 - Spark wraps it
        reader(spark, cluster, assign='{"nowhere": ["1-0"]}').collect()
    with cluster.client(Admin) as admin:
        assert "nowhere" not in admin.topics()
