"""ZooKeeper state against a real server (one per module, no mocks): the path layout, broker
registration (nodes and data, duplicate ids, runtime topics, stop, coming back after a ZooKeeper restart
and after a session expiry), the clients' cluster view, and consumer-group state."""
import json
import threading
import time
import uuid

import pytest
from conftest import wait_until
from kazoo.client import KazooClient, KazooState

from metaq_broker.client.cluster import ClusterView
from metaq_broker.devtools.zookeeper import LocalZooKeeper, free_port
from metaq_broker.names import parse_partition_name, partition_name
from metaq_broker.server.registration import BrokerIdInUseError, BrokerRegistration
from metaq_broker.zk.group_offsets import ConsumerIdInUseError, GroupStore, range_assign
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import ZooKeeperUnavailableError

pytestmark = pytest.mark.unit


# -- paths (no server) ----------------------------------------------------------------------------------
def test_paths_follow_the_metaq_layout():
    p = ZkPaths()
    assert p.root == "/meta"
    # metaq's own nodes are where MetaQ 1.4 clients never look (MetaQ's own: tests/test_metaq_zk_layout.py)
    assert p.broker_ids() == "/meta/brokers/metaq/ids" and p.broker(3) == "/meta/brokers/metaq/ids/3"
    assert p.topics() == "/meta/brokers/metaq/topics" and p.topic("orders") == "/meta/brokers/metaq/topics/orders"
    assert p.topic_entry("orders", 3) == "/meta/brokers/metaq/topics/orders/3-m"
    assert p.consumers() == "/meta/consumers" and p.group("g") == "/meta/consumers/g"
    assert p.group_ids("g") == "/meta/consumers/g/ids" and p.group_member("g", "c1") == "/meta/consumers/g/ids/c1"
    assert p.group_offset_topics("g") == "/meta/consumers/g/metaq/offsets"
    assert p.group_offsets("g", "t") == "/meta/consumers/g/metaq/offsets/t"
    assert p.group_offset("g", "t", "3-12") == "/meta/consumers/g/metaq/offsets/t/3-12"
    assert p.group_owners("g", "t") == "/meta/consumers/g/owners/t"
    assert p.group_owner("g", "t", "3-12") == "/meta/consumers/g/owners/t/3-12"
    assert p.sinks() == "/meta/sinks" and p.sink_batches("s") == "/meta/sinks/s/batches"
    assert p.sink_batch("s", 7) == "/meta/sinks/s/batches/00000000000000000007"
    assert p.sink_batch("s", 2**63 - 1).rsplit("/", 1)[1] == "09223372036854775807"


def test_root_is_normalised():
    assert ZkPaths("/meta/").root == ZkPaths("meta").root == ZkPaths("//meta").root == "/meta"
    assert ZkPaths("/a/b/").broker(1) == "/a/b/brokers/metaq/ids/1"
    for no_prefix in ("", "/", None):
        assert ZkPaths(no_prefix).broker(1) == "/brokers/metaq/ids/1"
    with pytest.raises(ValueError, match="'..'"):
        ZkPaths("/a/../b")


def test_partition_names():
    assert parse_partition_name("3-12") == (3, 12) and partition_name(3, 12) == "3-12"
    assert parse_partition_name(partition_name(0, 0)) == (0, 0)
    for bad in ["3", "a-1", "1-", "-1-2", "1-2-3", "01-2", " 1-2", "1-2\n", "", None, 12]:
        with pytest.raises(ValueError, match="<brokerId>-<n>"):
            parse_partition_name(bad)
    for b, n in [(-1, 0), (1, -2), ("1", 2), (1.0, 2), (True, 1)]:
        with pytest.raises(ValueError, match="broker id|partition number"):
            partition_name(b, n)
    with pytest.raises(ValueError, match="<brokerId>-<n>"):
        ZkPaths().group_offset("g", "t", "0")


def test_names_that_cannot_be_path_components_are_refused():
    p = ZkPaths()
    for kind, call in [("topic", p.topic), ("group", p.group), ("sink id", p.sink_batches)]:
        for bad, problem in [("a/b", "contains '/'"), ("..", "reserved"), (".", "reserved"), ("", "empty"),
                             ("a\x00b", "control")]:
            with pytest.raises(ValueError, match=f"^{kind} .*ZooKeeper path: .*{problem}"):
                call(bad)
    with pytest.raises(ValueError, match="batch id must be non-negative"):
        p.sink_batch("s", -1)
    with pytest.raises(ValueError, match="consumer id"):
        p.group_member("g", "x/y")


def test_range_assignment_rule():
    parts = ["1-0", "1-1", "2-0", "2-1", "10-0"]  # numeric order, not string order
    assert range_assign(["b", "a"], parts, "a") == ["1-0", "1-1", "2-0"]
    assert range_assign(["b", "a"], parts, "b") == ["2-1", "10-0"]
    assert range_assign(["a"], reversed(parts), "a") == parts
    assert range_assign(["a", "b", "c"], ["1-0"], "b") == []
    assert range_assign(["a"], parts, "z") == []
    shares = [range_assign(list("abc"), [f"1-{i}" for i in range(8)], m) for m in "abc"]
    assert [len(s) for s in shares] == [3, 3, 2] and sum(shares, []) == [f"1-{i}" for i in range(8)]


# -- a real ZooKeeper -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zk_server(tmp_path_factory):
    """This module's own ZooKeeper (tests restart it). A short tick lets sessions be a few seconds."""
    with LocalZooKeeper(data_dir=tmp_path_factory.mktemp("zk"), tick_time_ms=500) as zk:
        yield zk


@pytest.fixture
def root():
    return f"/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def zk(zk_server):
    c = KazooClient(zk_server.connect_string)
    c.start(15)
    yield c
    c.stop()
    c.close()


def registration(zk_server, root, broker_id=1, topics=None, port=9000, session_timeout=4.0):
    return BrokerRegistration(zk_server.connect_string, root, broker_id,
                              {"host": "127.0.0.1", "port": port, "brokerId": broker_id, "version": "test"},
                              {"orders": 2} if topics is None else topics, session_timeout=session_timeout)


def exists(zk, path):
    """``zk.exists`` that answers None while the client is reconnecting after a server restart."""
    try:
        return zk.exists(path)
    except Exception:  # noqa: BLE001
        return None


@pytest.mark.process
def test_registration_writes_the_nodes_and_stop_removes_the_broker_node_only(zk_server, zk, root):
    p = ZkPaths(root)
    reg = registration(zk_server, root, topics={"orders": 2, "logs": 1}).start()
    try:
        assert reg.connected and reg.registrations == 1
        data, stat = zk.get(p.broker(1))
        assert json.loads(data) == {"host": "127.0.0.1", "port": 9000, "brokerId": 1, "version": "test"}
        assert stat.ephemeralOwner == reg.client.client_id[0]
        data, stat = zk.get(p.topic_entry("orders", 1))
        assert json.loads(data) == {"numPartitions": 2, "brokerId": 1} and stat.ephemeralOwner == 0
        assert json.loads(zk.get(p.topic_entry("logs", 1))[0])["numPartitions"] == 1

        reg.add_topic("events", 4)  # a topic created at runtime
        assert json.loads(zk.get(p.topic_entry("events", 1))[0]) == {"numPartitions": 4, "brokerId": 1}
        reg.set_topics({"orders": 3, "events": 4})  # resize one, drop "logs"
        assert json.loads(zk.get(p.topic_entry("orders", 1))[0])["numPartitions"] == 3
        assert zk.exists(p.topic_entry("logs", 1)) is None
        with pytest.raises(ValueError, match="ZooKeeper path"):
            reg.add_topic("a/b", 1)
    finally:
        reg.stop()
    assert not reg.connected
    assert zk.exists(p.broker(1)) is None
    # the topic entries stay: a stopped broker's partitions are down, not gone (keys keep their partition)
    for path in (p.topic_entry("orders", 1), p.topic_entry("events", 1)):
        assert zk.exists(path), path
    # started again without "events" (dropped while it was down): its stale entries go at registration
    reg = registration(zk_server, root, topics={"orders": 3}).start()
    try:
        assert zk.exists(p.topic_entry("orders", 1))
        assert zk.exists(p.topic_entry("events", 1)) is None
    finally:
        reg.stop()


@pytest.mark.process
def test_second_registration_with_the_same_id_is_refused(zk_server, zk, root):
    first = registration(zk_server, root, broker_id=7, port=9000).start()
    try:
        dup = registration(zk_server, root, broker_id=7, port=9001)
        started = time.monotonic()
        with pytest.raises(BrokerIdInUseError, match=r"broker id 7 is already registered.*9000") as e:
            dup.start()
        assert time.monotonic() - started < 5  # a different address: refused at once, no waiting
        assert e.value.broker_id == 7 and e.value.holder["port"] == 9000
        assert not dup.connected
        # The refused one did not touch the holder's nodes.
        assert zk.get(ZkPaths(root).broker(7))[1].ephemeralOwner == first.client.client_id[0]
        assert zk.exists(ZkPaths(root).topic_entry("orders", 7))
    finally:
        first.stop()


@pytest.mark.process
def test_a_stale_node_with_our_own_address_is_waited_out(zk_server, zk, root):
    """A crashed previous run of this broker leaves its ephemeral node until its session expires."""
    ghost = KazooClient(zk_server.connect_string)
    ghost.start(15)
    reg = registration(zk_server, root, broker_id=3, port=9100)
    ghost.create(ZkPaths(root).broker(3), json.dumps(reg.address, sort_keys=True).encode(),
                 ephemeral=True, makepath=True)
    threading.Timer(1.0, lambda: (ghost.stop(), ghost.close())).start()  # the old session ends
    try:
        reg.start()
        assert zk.get(ZkPaths(root).broker(3))[1].ephemeralOwner == reg.client.client_id[0]
    finally:
        reg.stop()


@pytest.mark.process
def test_registration_comes_back_after_a_zookeeper_restart(zk_server, zk, root):
    p = ZkPaths(root)
    reg = registration(zk_server, root, broker_id=2).start()
    try:
        zk_server.restart(down_for=0.5)
        wait_until(lambda: KazooState.SUSPENDED in reg.state_history and reg.connected, timeout=30,
                   what="the registration reconnecting")
        wait_until(lambda: exists(zk, p.broker(2)), timeout=30, what="broker node after restart")
        assert json.loads(zk.get(p.topic_entry("orders", 2))[0])["numPartitions"] == 2

        # A reconnect without expiry still checks the node: remove it behind the broker's back, then
        # make it reconnect; it must put the node back.
        zk.delete(p.broker(2))
        zk_server.restart()
        wait_until(lambda: exists(zk, p.broker(2)), timeout=30, what="node re-created after a reconnect")
        assert zk.exists(p.broker(2)).ephemeralOwner == reg.client.client_id[0]
    finally:
        reg.stop()


@pytest.mark.process
def test_registration_comes_back_after_session_expiry(zk_server, zk, root):
    p = ZkPaths(root)
    reg = registration(zk_server, root, broker_id=4).start()
    try:
        old_session = reg.client.client_id[0]
        # Expire the session from outside: a second client takes it over and closes it.
        thief = KazooClient(zk_server.connect_string, client_id=reg.client.client_id)
        thief.start(15)
        thief.stop()
        thief.close()

        def registered_again():
            stat = exists(zk, p.broker(4))
            return stat is not None and stat.ephemeralOwner not in (0, old_session)
        wait_until(registered_again, timeout=30, what="re-registration after session expiry")
        assert KazooState.LOST in reg.state_history
        assert zk.exists(p.broker(4)).ephemeralOwner == reg.client.client_id[0] != old_session
        assert json.loads(zk.get(p.broker(4))[0])["port"] == 9000
        # Topics added after the expiry are written by the new session too.
        reg.add_topic("late", 2)
        assert json.loads(zk.get(p.topic_entry("late", 4))[0])["numPartitions"] == 2
    finally:
        reg.stop()
    assert zk.exists(p.broker(4)) is None


def test_unreachable_zookeeper_is_a_clear_error():
    reg = BrokerRegistration(f"127.0.0.1:{free_port()}", "/meta", 1, {"host": "h", "port": 1}, {})
    with pytest.raises(ZooKeeperUnavailableError, match="cannot connect to ZooKeeper at 127.0.0.1:.* within 1s"):
        reg.start(timeout=1)


# -- the clients' view ----------------------------------------------------------------------------------
def test_cluster_view_static_list():
    calls = []

    def topics():
        calls.append(1)
        return {"t": [(2, 1), (1, 0), (2, 0)], "a": [(1, 1), (1, 0)]}

    def data(bid):
        calls.append(bid)
        return {1: "h1:7"}.get(bid)

    view = ClusterView(brokers={1: "h1:1", 2: "h2:2"}, static_topics=topics, static_data=data)
    assert view.brokers() == {1: "h1:1", 2: "h2:2"} and view.zk is None
    assert view.topic_partitions("t") == [(1, 0), (2, 0), (2, 1)] and view.topic_partitions("x") == []
    assert view.topics() == ["a", "t"] and view.topic_partitions("a") == [(1, 0), (1, 1)]
    assert len(calls) == 1  # the map is reused for a while, not asked for on every lookup
    assert [view.data_address(b) for b in (1, 2, 1, 2)] == ["h1:7", None, "h1:7", None]
    assert calls[1:] == [1, 2]  # each broker asked once, its answer (or none) reused
    assert ClusterView(brokers={1: "h1:1"}).data_address(1) is None
    with pytest.raises(ValueError, match="exactly one"):
        ClusterView()


@pytest.mark.process
def test_cluster_view_follows_brokers_and_topics(zk_server, zk, root):
    reg1 = registration(zk_server, root, 1, {"orders": 2}, port=9001).start()
    reg2 = registration(zk_server, root, 2, {"orders": 1, "logs": 3}, port=9002).start()
    view = ClusterView(zk_connect=zk_server.connect_string, root=root)
    try:
        assert view.brokers() == {1: "127.0.0.1:9001", 2: "127.0.0.1:9002"}  # filled before __init__ returns
        assert view.topics() == ["logs", "orders"]
        assert view.topic_partitions("orders") == [(1, 0), (1, 1), (2, 0)]
        assert view.topic_partitions("logs") == [(2, 0), (2, 1), (2, 2)]
        # Asking about a topic that does not exist creates nothing, and it is picked up once it does.
        assert view.topic_partitions("later") == []
        assert zk.exists(ZkPaths(root).topic("later")) is None
        changes = []
        view.on_change(lambda: changes.append(1))
        reg1.add_topic("later", 2)
        wait_until(lambda: view.topic_partitions("later") == [(1, 0), (1, 1)], what="new topic")
        reg1.add_topic("orders", 3)  # more partitions on broker 1
        wait_until(lambda: view.topic_partitions("orders") == [(1, 0), (1, 1), (1, 2), (2, 0)], what="resize")

        reg2.stop()  # broker 2 goes away
        wait_until(lambda: view.brokers() == {1: "127.0.0.1:9001"}, what="broker 2 gone")
        assert view.topic_partitions("orders") == [(1, 0), (1, 1), (1, 2)]
        assert view.topic_partitions("logs") == []
        assert changes

        # A broker whose node vanishes but whose (persistent) topic entries stay is not routed to.
        zk.delete(ZkPaths(root).broker(1))
        wait_until(lambda: view.topic_partitions("orders") == [], what="dead broker filtered")
        # ... and is routed to again once its registration notices (on the next reconnect) and re-creates it.
        zk_server.restart()
        wait_until(lambda: view.brokers() == {1: "127.0.0.1:9001"}, timeout=30, what="broker 1 back")
        wait_until(lambda: len(view.topic_partitions("orders")) == 3, what="its partitions back")
        with pytest.raises(ValueError, match="ZooKeeper path"):
            view.topic_partitions("a/b")
    finally:
        view.close()
        reg1.stop()
        reg2.stop()


# -- consumer groups ------------------------------------------------------------------------------------
@pytest.mark.process
def test_group_offsets_round_trip(zk, root):
    g = GroupStore(zk, root)
    assert g.fetch("g1", "t") == {} and g.groups() == [] and g.group_topics("g1") == []
    g.commit("g1", "t", {"1-0": 5, "1-1": 7, "10-0": 0})
    g.commit("g1", "t", {"1-0": 6})  # a partial commit leaves the others
    assert g.fetch("g1", "t") == {"1-0": 6, "1-1": 7, "10-0": 0}
    assert list(g.fetch("g1", "t")) == ["1-0", "1-1", "10-0"]
    assert zk.get(f"{root}/consumers/g1/metaq/offsets/t/1-0")[0] == b"6"  # ASCII decimal, beside MetaQ's node
    g.commit("g1", "u", {"2-0": 1})
    g.commit("g2", "t", {"1-0": 1})
    g.commit("g2", "t", {})
    assert g.groups() == ["g1", "g2"] and g.group_topics("g1") == ["t", "u"] and g.fetch("g2", "t") == {"1-0": 1}
    for bad, match in [({"1-0": -1}, "non-negative"), ({"1-0": "5"}, "non-negative"), ({"x": 1}, "<brokerId>-<n>")]:
        with pytest.raises(ValueError, match=match):
            g.commit("g1", "t", bad)
    assert g.fetch("g1", "t")["1-0"] == 6  # a refused commit wrote nothing
    zk.create(f"{root}/consumers/g1/metaq/offsets/t/junk", b"x")  # foreign children are skipped
    zk.create(f"{root}/consumers/g1/offsets/t/junk", b"5", makepath=True)
    zk.create(f"{root}/consumers/g1/offsets/t/10-0", b"77-1234")  # MetaQ's form: its master translates it
    assert g.fetch("g1", "t") == {"1-0": 6, "1-1": 7, "10-0": 0}


@pytest.mark.process
def test_group_membership_assignment_and_ownership(zk_server, zk, root):
    other = KazooClient(zk_server.connect_string)  # the second consumer has its own session
    other.start(15)
    try:
        ga, gb = GroupStore(zk, root), GroupStore(other, root)
        parts = ["2-1", "1-0", "10-0", "1-1", "2-0"]
        ga.join("g", "a", ["t", "u"])
        gb.join("g", "b", ["t"])
        assert ga.members("g") == ["a", "b"] and gb.members("g", "u") == ["a"]
        assert zk.get(f"{root}/consumers/g/ids/a")[0] == b"t,u"
        assert ga.assign("g", "a", "t", parts) == ["1-0", "1-1", "2-0"]
        assert gb.assign("g", "b", "t", parts) == ["2-1", "10-0"]
        assert ga.assign("g", "a", "u", parts) == sorted(parts, key=parse_partition_name)  # b is not on "u"
        assert gb.assign("g", "b", "u", parts) == [] and ga.assign("g", "nobody", "t", parts) == []
        with pytest.raises(ConsumerIdInUseError, match="'a'"):
            gb.join("g", "a", ["t"])

        assert ga.claim("g", "t", "1-0", "a") and ga.claim("g", "t", "1-0", "a")  # idempotent
        assert not gb.claim("g", "t", "1-0", "b")  # owned by a live member
        assert not gb.release("g", "t", "1-0", "b")  # not the owner: no effect
        assert ga.owners("g", "t") == {"1-0": "a"}
        assert ga.release("g", "t", "1-0", "a") and gb.claim("g", "t", "1-0", "b")
        assert ga.owners("g", "t") == {"1-0": "b"}

        # b's session ends (it crashed): its membership and ownership go with it.
        other.stop()
        assert ga.members("g") == ["a"] and ga.owners("g", "t") == {}
        assert ga.assign("g", "a", "t", parts) == sorted(parts, key=parse_partition_name)
        assert ga.claim("g", "t", "1-0", "a")
        ga.leave("g", "a")
        ga.leave("g", "a")
        assert ga.members("g") == []
    finally:
        other.stop()
        other.close()
