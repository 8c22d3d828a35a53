"""MetaQ 1.4's ZooKeeper layout as real brokers write it (``metaqPort``), read by the test MetaQ client
(tests/metaq_client.py, written from the protocol description), beside metaq's own nodes: a producer finds
the master's ``meta://`` URI and the partition counts, a consumer group's offsets are readable in both
forms (metaq's logical offset and MetaQ's ``<msgId>-<byteOffset>``) whichever side committed, and a
replicated group's ``master`` and ``slave<n>`` follow its elections (the listener itself:
test_metaq_listener.py). Faults:
a crash and a restart without ``metaqPort``, a killed master, ZooKeeper losing its data."""
import errno
import json
import socket

import pytest
from kazoo.client import KazooClient

from conftest import wait_until
from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.zookeeper import LocalZooKeeper
from metaq_broker.errors import ConfigError
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from zk_loss import wipe
from tests.metaq_client import Cluster, GroupConsumer

TOPIC = "orders"


@pytest.fixture
def zk(zookeeper, zk_root):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


def metaq_size(value: bytes, attribute=None) -> int:
    """A message's bytes in MetaQ's message-set layout (seed notes §2.2): 20-byte head, attribute, payload."""
    return 20 + len(value) + (0 if attribute is None else 4 + len(attribute.encode()))


def metaq_port(zk, root, broker_id) -> int:
    return json.loads(zk.get(ZkPaths(root).broker(broker_id))[0])["metaqPort"]


def test_a_metaq_client_finds_brokers_with_a_metaq_port_and_only_those(cluster, zk, zk_root):
    cluster.start_broker(1, settings={"metaqPort": 0, "numPartitions": 2}, topics={TOPIC: {}})
    cluster.start_broker(2, settings={"numPartitions": 3}, topics={TOPIC: {}, "other": {}})
    layout = MetaqZkLayout(zk_root)
    wait_until(lambda: zk.exists(layout.broker_master(1)), what="MetaQ's master node")
    port = metaq_port(zk, zk_root, 1)
    uri = f"meta://127.0.0.1:{port}".encode()

    data, stat = zk.get(layout.broker(1))
    assert data == uri and stat.ephemeralOwner == 0  # persistent; the URI for clients before 1.4
    data, stat = zk.get(layout.broker_master(1))
    assert data == uri and stat.ephemeralOwner != 0
    for path in (layout.topic_pub_broker(TOPIC, 1), layout.topic_sub_broker(TOPIC, 1)):
        data, stat = zk.get(path)
        assert data == b'{"numParts":2,"broker":"1-m"}' and stat.ephemeralOwner  # exactly MetaQ's two fields
    assert zk.get(layout.topic_legacy_broker(TOPIC, 1))[0] == b"2"  # the count of clients before 1.4.3

    metaq = Cluster(zk, zk_root)
    assert metaq.partitions(TOPIC) == metaq.partitions(TOPIC, "sub") == [(1, 0), (1, 1)]  # broker 2: no listener
    assert metaq.address(1) == ("127.0.0.1", port)
    # broker 2 has no MetaQ node but the persistent one every master makes sure of (empty: no URI)
    assert zk.get(layout.broker(2))[0] == b"" and zk.get_children(layout.broker(2)) == []
    assert zk.exists(layout.topic_pub("other")) is None
    # metaq's own view is unchanged: every broker's partitions
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.topic_partitions(TOPIC)) == 5, what="metaq's view of both")

    # The port is the broker's MetaQ listener (nobody else gets it), found through MetaQ's nodes.
    assert metaq.connection(1).version()
    metaq.close()
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE

    cluster.brokers[1].stop()
    assert zk.exists(layout.broker_master(1)) is None and zk.exists(layout.topic_pub_broker(TOPIC, 1)) is None
    assert zk.get(layout.broker(1))[0] == b""  # no URI of a broker that is gone
    assert metaq.partitions(TOPIC) == []

    cluster.brokers[2].stop()  # `metaq brokers --forget`: MetaQ's node of the group goes too
    with cluster.client(Admin) as admin:
        assert admin.forget_broker(2) == ["orders", "other"]
    assert zk.exists(layout.broker(2)) is None and zk.exists(ZkPaths(zk_root).topic_entry(TOPIC, 2)) is None


def test_a_broker_restarted_without_its_metaq_port_no_longer_names_it(cluster, zk, zk_root):
    layout = MetaqZkLayout(zk_root)
    cluster.start_broker(1, settings={"metaqPort": 0}, topics={TOPIC: {}})
    wait_until(lambda: zk.exists(layout.broker_master(1)), what="MetaQ's master node")
    assert zk.get(layout.broker(1))[0].startswith(b"meta://")
    cluster.brokers[1].kill()  # a crash: nothing withdrawn; its session lives on for zk.sessionTimeout
    cluster.brokers[1].settings.pop("metaqPort")
    cluster.brokers[1].start()  # takes its crashed run's nodes over at once (same data directory)
    wait_until(lambda: zk.get(layout.broker(1))[0] == b"", what="the old URI emptied")
    wait_until(lambda: zk.exists(layout.broker_master(1)) is None, what="the crashed run's session expired")
    assert Cluster(zk, zk_root).partitions(TOPIC) == []


def test_group_offsets_are_readable_in_both_forms_whichever_side_commits(cluster, zk, zk_root):
    cluster.start_broker(1, settings={"metaqPort": 0, "numPartitions": 1}, topics={TOPIC: {}})
    values = [b"v" * (10 + 7 * i) for i in range(8)]
    attributes = [None if i % 3 else f"attr-{i}" for i in range(8)]
    with cluster.client(Producer) as producer:
        wait_until(lambda: producer.cluster.topic_partitions(TOPIC), what="topic")
        producer.send_batch(TOPIC, values[:5], attributes=attributes[:5], partition="1-0")
        producer.send_batch(TOPIC, values[5:], attributes=attributes[5:], partition="1-0")
    ends = [0]
    for v, a in zip(values, attributes):
        ends.append(ends[-1] + metaq_size(v, a))
    layout, metaq = MetaqZkLayout(zk_root), Cluster(zk, zk_root)
    node = layout.group_offset("billing", TOPIC, "1-0")

    with cluster.client(Consumer, group="billing") as consumer:
        ids = consumer.read_range(TOPIC, "1-0", 0, 8).column("msgId").to_pylist()
        consumer.commit(TOPIC, {"1-0": 3})  # metaq's side: the next offset to read
        wait_until(lambda: zk.exists(node) and zk.get(node)[0] == f"{ids[2]}-{ends[3]}".encode(),
                   what="MetaQ's form of metaq's commit")
        member = GroupConsumer(metaq, "billing", TOPIC)
        member.join()  # reads the offset as a MetaQ consumer does
        assert member.positions == {"1-0": (ids[2], ends[3])}

        member.positions["1-0"] = (ids[6], ends[7])  # MetaQ's side: consumed through message 6
        member.commit()
        wait_until(lambda: consumer.committed(TOPIC) == {"1-0": 7}, what="metaq's form of MetaQ's commit")
        with cluster.client(Admin) as admin:
            (row,) = admin.group_lag("billing", TOPIC)
            assert (row.partition, row.committed, row.lag) == ("1-0", 7, 1)  # `metaq groups` sees it
        member.positions["1-0"] = (-1, ends[5] + 3)  # inside message 5 (no id): that message, nothing skipped
        member.commit()
        wait_until(lambda: consumer.committed(TOPIC) == {"1-0": 5}, what="a position inside a message")
        assert zk.get(node)[0] == f"-1-{ends[5] + 3}".encode()  # the MetaQ consumer's own value is left as it is
        member.leave()

        consumer.commit(TOPIC, {"1-0": 8})  # and metaq's again, to the end
        wait_until(lambda: zk.get(node)[0] == f"{ids[7]}-{ends[8]}".encode(), what="the end position")
    assert GroupStore(zk, zk_root).fetch("billing", TOPIC) == {"1-0": 8}


def test_a_replicated_groups_master_and_slave_nodes_follow_its_elections(tmp_path, zookeeper, zk, zk_root):
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2,
                        settings={"metaqPort": 0, "numPartitions": 2}, topics={TOPIC: {}}).start()
    layout = MetaqZkLayout(zk_root)

    def uri(replica_id):
        info = json.loads(zk.get(ZkPaths(zk_root).group_replica(1, replica_id))[0])
        return f"meta://127.0.0.1:{info['metaqPort']}".encode()

    try:
        first = group.wait_master()
        other = 1 - first
        wait_until(lambda: zk.exists(layout.broker_master(1)) and zk.exists(layout.broker_slave(1, other)),
                   what="master and slave nodes")
        assert zk.get(layout.broker_master(1))[0] == uri(first) == zk.get(layout.broker(1))[0]
        assert zk.get(layout.broker_slave(1, other))[0] == uri(other)
        assert zk.exists(layout.broker_slave(1, first)) is None
        assert Cluster(zk, zk_root).partitions(TOPIC) == [(1, 0), (1, 1)]

        group.members[first].stop()  # hands over to the in-sync replica
        assert group.wait_master(other_than=first) == other
        wait_until(lambda: zk.exists(layout.broker_master(1)) and zk.get(layout.broker_master(1))[0] == uri(other),
                   what="the new master's MetaQ node")
        assert zk.get(layout.broker(1))[0] == uri(other)
        assert zk.exists(layout.broker_slave(1, other)) is None  # a master is no slave
        assert Cluster(zk, zk_root).partitions(TOPIC) == [(1, 0), (1, 1)]
        assert Cluster(zk, zk_root).address(1)[1] == int(uri(other).rsplit(b":", 1)[1])

        group.members[first].start()  # back as a replica: its slave node
        wait_until(lambda: zk.exists(layout.broker_slave(1, first)), what="the old master as a slave")
        assert zk.get(layout.broker_master(1))[0] == uri(other)
    finally:
        group.stop()


@pytest.mark.unit
@pytest.mark.parametrize("raw,match", [("meta", "'meta' is not an integer"), ("-2", "-2 is outside -1..65535"),
                                       ("65536", "65536 is outside")])
def test_bad_metaq_port_values_are_refused_naming_the_key(raw, match):
    with pytest.raises(ConfigError, match=rf"\[system\] metaqPort: {match}"):
        load(None, {"metaqPort": raw})
    assert load(None).metaq_port == -1  # off unless asked for


@pytest.mark.process
def test_a_taken_metaq_port_stops_the_broker_at_start_and_a_stopped_broker_frees_it(tmp_path):
    def start(name, port):
        return Broker(load(None, {"brokerId": "1", "serverPort": "0", "zk.connect": "none", "kafkaPort": "0", "metaqPort": str(port),
                                  "dataPath": str(tmp_path / name)})).start()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metaqPort: cannot bind 127.0.0.1:{port}"):
            start("taken", port)
    broker = start("free", port)
    try:
        assert broker.metaq_port == port
    finally:
        broker.stop()
    with socket.socket() as again:  # released with the broker
        again.bind(("127.0.0.1", port))


@pytest.mark.process
def test_metaqs_nodes_follow_a_killed_master_and_zookeeper_losing_its_data(tmp_path):
    """kill -9 of the master: the new master's URI is in MetaQ's ``master`` once the old session expires;
    ZooKeeper wiped while both run: MetaQ's nodes are written again by whichever member is elected."""
    with LocalZooKeeper(data_dir=tmp_path / "zk", tick_time_ms=500) as server:
        group = BrokerGroup(tmp_path / "g", 1, server.connect_string, "/meta", members=2,
                            settings={"metaqPort": 0}, topics={TOPIC: {}}).start()
        layout = MetaqZkLayout("/meta")
        zk = group.zk  # a session that survives ZooKeeper losing its data (a plain kazoo client's would not)

        def master_uri():
            try:
                return zk.get(layout.broker_master(1))[0]
            except Exception:  # noqa: BLE001 - gone, or ZooKeeper restarting
                return None

        def uri_of(replica_id):
            info = json.loads(zk.get(ZkPaths("/meta").group_replica(1, replica_id))[0])
            return f"meta://127.0.0.1:{info['metaqPort']}".encode()

        try:
            first = group.wait_master()
            group.wait_in_sync([0, 1])
            wait_until(lambda: master_uri() == uri_of(first), what="MetaQ's master node")
            other = 1 - first
            survivor_uri = uri_of(other)
            group.members[first].kill()
            assert group.wait_master(other_than=first, timeout=30) == other
            wait_until(lambda: master_uri() == survivor_uri, timeout=30, what="the new master's URI")
            owner = zk.exists(layout.broker_master(1)).ephemeralOwner
            assert zk.exists(layout.topic_pub_broker(TOPIC, 1)).ephemeralOwner == owner  # the new master's session

            group.members[first].start()
            group.wait_in_sync([0, 1], timeout=60)
            wipe(server)  # while both run
            group.wait_master(timeout=60)
            wait_until(lambda: master_uri() is not None and master_uri() == uri_of(group.master_id()), timeout=60,
                       what="MetaQ's master node after ZooKeeper lost its data")
            wait_until(lambda: zk.exists(layout.topic_pub_broker(TOPIC, 1)), timeout=30, what="its topic entries")
            assert Cluster(zk, "/meta").partitions(TOPIC) == [(1, 0)]
        finally:
            group.stop()
