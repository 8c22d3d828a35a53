"""ZooKeeper pieces against a real server: paths, broker registration surviving a ZooKeeper restart and
a session expiry, duplicate ids, the clients' cluster view and group state."""
import json

import pytest
from kazoo.client import KazooClient

from conftest import wait_until
from metaq_broker.client.cluster import ClusterView
from metaq_broker.client.group_offsets import GroupStore
from metaq_broker.registry import BrokerIdInUseError, BrokerRegistration
from metaq_broker.zkpaths import ZkPaths, parse_partition_name, partition_name
from metaq_broker.zookeeper import LocalZooKeeper


def test_paths_follow_metaq_layout():
    p = ZkPaths("/meta/")
    assert p.broker(3) == "/meta/brokers/ids/3"
    assert p.topic_pub_broker("orders", 3) == "/meta/brokers/topics-pub/orders/3-m"
    assert p.topic_sub_broker("orders", 3) == "/meta/brokers/topics-sub/orders/3-m"
    assert p.group_offset("g", "orders", "3-1") == "/meta/consumers/g/offsets/orders/3-1"
    assert p.group_owner("g", "orders", "3-1") == "/meta/consumers/g/owners/orders/3-1"
    assert p.group_member("g", "c1") == "/meta/consumers/g/ids/c1"
    assert p.sink_batch("s", 7) == "/meta/sinks/s/batches/00000000000000000007"
    assert ZkPaths("/").broker(1) == "/brokers/ids/1" == ZkPaths("").broker(1)
    assert parse_partition_name("12-3") == (12, 3) and partition_name(12, 3) == "12-3"
    for bad in ["3", "a-1", "1-", "-1-2", "1-2-3"]:
        with pytest.raises(ValueError, match="<brokerId>-<n>"):
            parse_partition_name(bad)
    for bad in ["a/b", "..", ".", ""]:
        with pytest.raises(ValueError, match="ZooKeeper path"):
            p.group(bad)


def registration(zk, root, broker_id=1, topics=None, port=9000):
    return BrokerRegistration(zk.connect_string, root, broker_id, {"host": "127.0.0.1", "port": port},
                              topics or {"orders": 2}, session_timeout=4.0)


def test_registration_nodes_and_duplicate_ids(zookeeper, zk_root):
    reg = registration(zookeeper, zk_root).start()
    zk = KazooClient(zookeeper.connect_string)
    zk.start()
    try:
        p = ZkPaths(zk_root)
        data, stat = zk.get(p.broker(1))
        assert json.loads(data) == {"host": "127.0.0.1", "port": 9000} and stat.ephemeralOwner
        assert json.loads(zk.get(p.topic_pub_broker("orders", 1))[0]) == {"numPartitions": 2, "brokerId": 1}
        assert zk.exists(p.topic_sub_broker("orders", 1))
        with pytest.raises(BrokerIdInUseError, match="broker id 1 is already registered.*9000"):
            registration(zookeeper, zk_root, port=9001).start()
        reg.add_topic("logs", 5)
        assert json.loads(zk.get(p.topic_pub_broker("logs", 1))[0])["numPartitions"] == 5
        reg.stop()
        assert zk.exists(p.broker(1)) is None and zk.exists(p.topic_pub_broker("orders", 1)) is None
    finally:
        zk.stop()


def test_registration_survives_session_expiry(zookeeper, zk_root):
    reg = registration(zookeeper, zk_root).start()
    node = ZkPaths(zk_root).broker(1)
    try:
        first_session = reg.client.client_id[0]
        # Expire the session from outside: a second client takes it over and closes it.
        thief = KazooClient(zookeeper.connect_string, client_id=reg.client.client_id)
        thief.start()
        thief.stop()
        thief.close()
        watcher = KazooClient(zookeeper.connect_string)
        watcher.start()
        try:
            def registered_again():
                stat = watcher.exists(node)
                return stat is not None and stat.ephemeralOwner != first_session
            wait_until(registered_again, timeout=30, what="re-registration after session expiry")
            assert stat_owner(watcher, node) == reg.client.client_id[0]
        finally:
            watcher.stop()
    finally:
        reg.stop()


def stat_owner(zk, node):
    return zk.exists(node).ephemeralOwner


def test_registration_survives_a_zookeeper_restart(tmp_path):
    with LocalZooKeeper(data_dir=tmp_path / "zk") as zk_server:
        reg = registration(zk_server, "/meta").start()
        try:
            zk_server.restart(down_for=1.0)
            wait_until(lambda: reg.connected, timeout=30, what="reconnection")
            watcher = KazooClient(zk_server.connect_string)
            watcher.start()
            try:
                wait_until(lambda: watcher.exists("/meta/brokers/ids/1"), timeout=30, what="registration")
            finally:
                watcher.stop()
        finally:
            reg.stop()


def test_cluster_view_follows_brokers(zookeeper, zk_root):
    reg1 = registration(zookeeper, zk_root, 1, {"orders": 2}, port=9001).start()
    reg2 = registration(zookeeper, zk_root, 2, {"orders": 1, "logs": 3}, port=9002).start()
    view = ClusterView(zk_connect=zookeeper.connect_string, root=zk_root)
    try:
        wait_until(lambda: len(view.brokers()) == 2, what="two brokers")
        assert view.brokers() == {1: "127.0.0.1:9001", 2: "127.0.0.1:9002"}
        assert view.topics() == ["logs", "orders"]
        wait_until(lambda: view.topic_partitions("orders") == [(1, 0), (1, 1), (2, 0)], what="partitions")
        changes = []
        view.on_change(lambda: changes.append(1))
        reg2.stop()
        wait_until(lambda: view.brokers() == {1: "127.0.0.1:9001"}, what="broker 2 gone")
        wait_until(lambda: view.topic_partitions("orders") == [(1, 0), (1, 1)], what="its partitions gone")
        assert changes
    finally:
        view.close()
        reg1.stop()


def test_group_store_offsets_members_and_owners(zookeeper, zk_root):
    zk = KazooClient(zookeeper.connect_string)
    zk.start()
    try:
        g = GroupStore(zk, zk_root)
        assert g.fetch("g", "t") == {} and g.groups() == []
        g.commit("g", "t", {"1-0": 5, "1-1": 7})
        g.commit("g", "t", {"1-0": 6})
        assert g.fetch("g", "t") == {"1-0": 6, "1-1": 7}
        assert zk.get(f"{zk_root}/consumers/g/offsets/t/1-0")[0] == b"6"  # ASCII decimal, as MetaQ
        assert g.groups() == ["g"] and g.group_topics("g") == ["t"]
        parts = ["1-0", "1-1", "2-0", "2-1", "10-0"]
        g.join("g", "a", ["t"])
        g.join("g", "b", ["t"])
        assert g.members("g") == ["a", "b"]
        assert g.assign("g", "a", "t", parts) == ["1-0", "1-1", "2-0"]
        assert g.assign("g", "b", "t", parts) == ["2-1", "10-0"]
        assert g.assign("g", "stranger", "t", parts) == []
        assert g.claim("g", "t", "1-0", "a") and g.claim("g", "t", "1-0", "a")
        assert not g.claim("g", "t", "1-0", "b")
        g.release("g", "t", "1-0", "b")  # not the owner: no effect
        assert not g.claim("g", "t", "1-0", "b")
        g.release("g", "t", "1-0", "a")
        assert g.claim("g", "t", "1-0", "b")
        g.leave("g", "a")
        assert g.members("g") == ["b"]
    finally:
        zk.stop()
