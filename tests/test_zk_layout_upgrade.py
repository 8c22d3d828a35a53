"""A cluster of the ZooKeeper layout before issue 28 (metaq's master node at ``brokers/ids/<b>``, its topic
entries in ``topics-pub|sub``, its group offsets as bare decimals at ``consumers/<g>/offsets``), written here
by hand node for node, upgraded by a real broker on start: what it copies, what it removes (only copies),
what it leaves (a broker of the older layout that is still up; sink decisions, users, ACLs), and how an
upgraded client, an upgraded broker group member and the group offsets behave beside brokers and clients
that are not upgraded yet (docs/protocol.md, "Upgrading from the layout before issue 28")."""
import json
import time

import pytest
from kazoo.exceptions import NodeExistsError

from conftest import wait_until
from metaq_broker.client.cluster import ClusterView
from metaq_broker.client.producer import Producer
from metaq_broker.zk import groups
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.groups import ElectionLostError, GroupState
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths

U0 = "0" * 31 + "a"
OLD_ENTRY = '{{"numPartitions": {n}, "brokerId": {b}}}'


def old_master(zk, root, broker_id, port, **extra):
    """The master node a broker of the older layout registers: ephemeral JSON at ``brokers/ids/<b>``."""
    info = {"host": "127.0.0.1", "port": port, "brokerId": broker_id, "version": "0.old", "replicaId": 0,
            "securityProtocol": "PLAINTEXT", **extra}
    zk.create(MetaqZkLayout(root).broker(broker_id), json.dumps(info).encode(), ephemeral=True, makepath=True)


def old_entries(zk, root, topic, broker_id, n):
    layout = MetaqZkLayout(root)
    for path in (layout.topic_pub_broker(topic, broker_id), layout.topic_sub_broker(topic, broker_id)):
        zk.create(path, OLD_ENTRY.format(n=n, b=broker_id).encode(), makepath=True)


def test_a_newer_member_follows_an_older_master_and_never_stands_beside_it(zk_clients, zk_root):
    make, _ = zk_clients
    old, new = make(), make()
    paths, layout = ZkPaths(zk_root), MetaqZkLayout(zk_root)
    old.create(paths.group_state(5), GroupState(1, 0, ((0, U0),), (0,)).to_json(), makepath=True)  # both read it
    state = groups.read_state(old, paths, 5)
    old_master(old, zk_root, 5, 9000, uuid=U0, instance="boot:1:2")  # an older member is master

    data, stat = groups.master_data(new, paths, 5)  # a newer member sees it as the master and follows it
    assert json.loads(data)["port"] == 9000 and stat.ephemeralOwner == old.client_id[0]
    assert groups.master_node(new, paths, 5)["port"] == 9000
    with pytest.raises(ElectionLostError, match="layout before issue 28"):
        groups.elect(new, paths, 5, 0, U0, b"{}", groups.read_state(new, paths, 5))
    assert groups.read_state(new, paths, 5) == state  # nothing was written

    # Restarted on the same data directory after a crash: that run's node is taken over at once.
    assert groups.take_over_stale(new, paths, 5, 0, U0, "boot:1:2") == [(layout.broker(5), old.client_id[0])]
    assert groups.master_data(new, paths, 5) == (None, None)
    won = groups.elect(new, paths, 5, 0, U0, b'{"replicaId": 0}', groups.read_state(new, paths, 5))
    assert won.epoch == state.epoch + 1
    assert new.exists(layout.broker(5)).ephemeralOwner == 0  # MetaQ's persistent node from now on
    with pytest.raises(NodeExistsError):  # so a member of the older layout can never be master beside this one
        old.create(layout.broker(5), b"{}", ephemeral=True)


def test_a_broker_upgrades_the_older_layout_on_start(cluster, zk_clients, zk_root):
    make, _ = zk_clients
    zk, old_broker = make(), make()
    paths, layout = ZkPaths(zk_root), MetaqZkLayout(zk_root)
    old_entries(zk, zk_root, "orders", 1, 2)  # this broker's own
    old_entries(zk, zk_root, "orders", 2, 1)  # a broker that is down
    old_entries(zk, zk_root, "orders", 3, 1)  # a broker of the older layout that is up
    old_master(old_broker, zk_root, 3, 9003)
    offsets = layout.group_offsets("g", "orders")
    zk.create(f"{offsets}/1-0", b"5", makepath=True)
    zk.create(f"{offsets}/1-1", b"6")
    zk.create(f"{offsets}/1-1/identity", b"f" * 32)
    zk.create(f"{offsets}/2-0", b"7")
    kept = {paths.sink_batch("s1", 7): b'{"decision": "commit"}', paths.user("alice"): b'{"SCRAM-SHA-256": "x"}',
            paths.acl_resource("topic", "literal", "orders"): b'{"version": 1, "acls": []}',
            paths.kafka_topic("orders"): b"kept as it was"}
    for path, data in kept.items():
        zk.create(path, data, makepath=True)

    cluster.start_broker(1, settings={"metaqPort": 0, "numPartitions": 2}, topics={"orders": {}})

    # topic entries: copied to metaq's nodes; the older ones removed but those of a broker up in that layout;
    # broker 1's own entry says its server.ini configures the topic (no deletion may remove it)
    for b, n, extra in ((1, 2, {"static": True}), (2, 1, {}), (3, 1, {})):
        assert json.loads(zk.get(paths.topic_entry("orders", b))[0]) == {"numPartitions": n, "brokerId": b, **extra}
    assert zk.get(layout.topic_pub_broker("orders", 1))[0] == b'{"numParts":2,"broker":"1-m"}'  # MetaQ's now
    assert zk.get(layout.topic_sub_broker("orders", 1))[0] == b'{"numParts":2,"broker":"1-m"}'
    assert zk.exists(layout.topic_pub_broker("orders", 2)) is None
    assert zk.exists(layout.topic_sub_broker("orders", 2)) is None
    assert json.loads(zk.get(layout.topic_pub_broker("orders", 3))[0])["numPartitions"] == 1
    # group offsets of this broker's partitions: copied (with their identity); the other broker's stay readable
    assert zk.get(paths.group_offset("g", "orders", "1-0"))[0] == b"5"
    assert zk.get(paths.group_offset("g", "orders", "1-1"))[0] == b"6"
    assert zk.get(f"{paths.group_offset('g', 'orders', '1-1')}/identity")[0] == b"f" * 32
    assert zk.exists(paths.group_offset("g", "orders", "2-0")) is None
    store = GroupStore(zk, zk_root)
    assert store.fetch("g", "orders") == {"1-0": 5, "1-1": 6, "2-0": 7}
    # MetaQ's nodes of this broker's partitions get MetaQ's form (offsets past this new log's end: its end)
    wait_until(lambda: zk.get(layout.group_offset("g", "orders", "1-0"))[0] == b"-1-0", what="MetaQ's form")
    assert zk.get(layout.group_offset("g", "orders", "2-0"))[0] == b"7"  # its broker is not upgraded yet
    for path, data in kept.items():
        assert zk.get(path)[0] == data, path

    # An upgraded client routes to the upgraded broker and to the older one alike.
    with cluster.client(Producer) as producer:
        view = producer.cluster
        wait_until(lambda: view.brokers() == {1: cluster.brokers[1].address, 3: "127.0.0.1:9003"},
                   what="both brokers")
        assert view.topic_partitions("orders") == [(1, 0), (1, 1), (3, 0)]
        assert view.registered_partitions("orders") == [(1, 0), (1, 1), (2, 0), (3, 0)]
        producer.send_batch("orders", [b"a", b"b", b"c"], partition="1-0")

        # An older client (or broker) commits a bare offset after the upgrade: it is the group's offset
        zk.set(layout.group_offset("g", "orders", "1-0"), b"2")
        assert store.fetch("g", "orders")["1-0"] == 2
        wait_until(lambda: zk.get(paths.group_offset("g", "orders", "1-0"))[0] == b"2", what="copied by the bridge")
        wait_until(lambda: zk.get(layout.group_offset("g", "orders", "1-0"))[0].endswith(b"-42"),
                   what="MetaQ's form of it")  # two 21-byte messages before offset 2
        store.commit("g", "orders", {"1-0": 1}, forward_only=True)
        assert store.fetch("g", "orders")["1-0"] == 2  # never backwards, whichever layout holds the newer one

        old_broker.stop()  # the older broker goes away
        wait_until(lambda: view.brokers() == {1: cluster.brokers[1].address}, what="older broker gone")
        assert view.registered_partitions("orders") == [(1, 0), (1, 1), (2, 0), (3, 0)]  # its entries stay


def test_an_older_master_still_up_is_followed_until_it_goes(cluster, zk_clients, zk_root):
    """A broker of the older layout holds the group's master node (up, or killed and its session not expired
    yet); the newer version of a member of that group starts: it does not stand while that node is there,
    and is master once it goes."""
    make, _ = zk_clients
    zk, ghost = make(), make()
    paths, layout = ZkPaths(zk_root), MetaqZkLayout(zk_root)
    old_master(ghost, zk_root, 1, 9001)
    cluster.start_broker(1, settings={"metaqPort": 0})
    wait_until(lambda: zk.exists(paths.group_replica(1, 0)), what="the member registered")
    time.sleep(1.0)  # several rounds of its role loop (0.25 s each): it must not stand
    assert zk.exists(paths.broker(1)) is None and zk.exists(layout.broker(1)).ephemeralOwner == ghost.client_id[0]
    ghost.stop()  # the older master goes
    wait_until(lambda: zk.exists(layout.broker_master(1)), what="master in both layouts")
    assert zk.exists(layout.broker(1)).ephemeralOwner == 0 and zk.exists(paths.broker(1)).ephemeralOwner
    with ClusterView(zk_connect=cluster.zk_connect, root=zk_root) as view:
        assert view.brokers() == {1: cluster.brokers[1].address}
