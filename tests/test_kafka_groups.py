"""The consumer-group APIs of the Kafka listener (server/kafka_groups.py) against a real ZooKeeper: a group's
members, assignment and committed offsets end to end, offsets kept under metaq's partition names where
``metaq groups`` reads them (with a real broker process, through the real command line), refusals with
Kafka's codes (generation, member, topic, partition, ACLs), member nodes kept in step (also after a new
ZooKeeper session), the broker's lag metrics, ZooKeeper away (retriable errors, members stay), the record
that lets another coordinator take a group over without a rebalance, a stale coordinator giving a group up,
groups moving when a broker joins, a group metaq's own consumers use, ListGroups, DescribeGroups and
DeleteGroups. Every answer is encoded at the versions served."""
import json
import time
import urllib.request

import pytest
from conftest import wait_until
import cli
from kazoo.client import KazooClient
from prometheus_client.parser import text_string_to_metric_families

from metaq_broker.client.producer import Producer
from metaq_broker.protocol.kafka import codes
from metaq_broker.protocol.kafka.messages import APIS
from metaq_broker.protocol.kafka.schema import decode, encode_parts
from metaq_broker.server import kafka_metadata as km
from metaq_broker.server.kafka_groups import KafkaGroups
from metaq_broker.server.registration import BrokerRegistration
from metaq_broker.zk import kafka_group_records as zk_groups
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.kafka_cluster import KafkaClusterCache
from metaq_broker.zk.paths import ZkPaths

JOIN, SYNC, HEARTBEAT, LEAVE, COMMIT, FETCH, LIST, DESCRIBE, DELETE = 11, 14, 12, 13, 8, 9, 16, 15, 42
T = 10  # seconds a parked request may take to be answered


def readable(api_key: int, body: dict, versions) -> dict:
    api = APIS[api_key]
    for v in versions:
        flexible = api.is_flexible(v)
        raw = b"".join(bytes(p) for p in encode_parts(api.response, v, flexible, body))
        out, _ = decode(api.response, v, flexible, raw)
    return out


def register(zookeeper, root, broker_id, topics):
    address = {"host": f"b{broker_id}.test", "port": 8000 + broker_id, "brokerId": broker_id,
               "kafkaPort": 9000 + broker_id}
    return BrokerRegistration(zookeeper.connect_string, root, broker_id, address, topics, session_timeout=4.0).start()


class Env:
    """Broker 5 registered with a Kafka address and topics orders (2 partitions: numbers 0, 1) and events (1),
    its cluster cache, and the group APIs as broker 5 would run them."""

    def __init__(self, zookeeper, root):
        self.zookeeper, self.root, self.paths = zookeeper, root, ZkPaths(root)
        self.zk = KazooClient(zookeeper.connect_string)
        self.zk.start(10)
        self.regs = [register(zookeeper, root, 5, {"orders": 2, "events": 1})]
        self.cache = KafkaClusterCache(self.zk, root)
        wait_until(lambda: {"orders", "events"} <= set(self.cache.snapshot().maps), what="topics numbered")
        self.groups = [self.new_groups()]

    @property
    def g(self) -> KafkaGroups:
        return self.groups[0]

    def new_groups(self, broker_id=5) -> KafkaGroups:
        groups = KafkaGroups(lambda: self.zk if self.zk.connected else None, self.root, broker_id, self.cache.snapshot,
                             initial_rebalance_delay_ms=0).start()
        self.cache.on_change(groups.cluster_changed)
        return groups

    def store(self) -> GroupStore:
        return GroupStore(self.zk, self.root)

    def close(self):
        for g in self.groups:
            g.close()
        self.cache.close()
        for r in self.regs:
            r.stop()
        self.zk.stop()
        self.zk.close()


@pytest.fixture
def env(zookeeper, zk_root):
    e = Env(zookeeper, zk_root)
    yield e
    e.close()


def join(g, group="app", member="", version=9, metadata=b"sub", instance=None):
    fut = g.join_group({"group_id": group, "member_id": member, "group_instance_id": instance,
                        "session_timeout_ms": 10_000, "rebalance_timeout_ms": 20_000, "protocol_type": "consumer",
                        "protocols": [{"name": "range", "metadata": metadata}]}, version, "app", "/10.1.1.1")
    return fut


def member(g, group="app") -> str:
    first = join(g, group).result(T)
    assert first["error_code"] == codes.MEMBER_ID_REQUIRED, first
    return first["member_id"]


def stable(g, group="app", n=1):
    ids = [member(g, group) for _ in range(n)]
    answers = [f.result(T) for f in [join(g, group, m) for m in ids]]
    gen, leader = answers[0]["generation_id"], answers[0]["leader"]
    syncs = [g.sync_group({"group_id": group, "generation_id": gen, "member_id": m, "group_instance_id": None,
                           "assignments": [{"member_id": x, "assignment": b"for " + x.encode()} for x in ids]
                           if m == leader else []}, 5) for m in ids]
    assert all(s.result(T)["error_code"] == codes.NONE for s in syncs)
    return ids, gen


def commit(g, group, generation, member_id, offsets, version=9, allows=None, **kw):
    topics = [{"name": t, "topic_id": kw.get("ids", {}).get(t, bytes(16)),
               "partitions": [{"partition_index": k, "committed_offset": o, "committed_metadata": kw.get("meta", "")}
                              for k, o in parts.items()]} for t, parts in offsets.items()]
    req = {"group_id": group, "generation_id_or_member_epoch": generation, "member_id": member_id,
           "group_instance_id": None, "topics": topics}
    body = g.offset_commit(req, version, allows) if allows else g.offset_commit(req, version)
    out = readable(COMMIT, body, [version])
    return {(t["name"] or t["topic_id"], p["partition_index"]): p["error_code"] for t in out["topics"]
            for p in t["partitions"]}


def fetch(g, group, topics, version=7, allows=None):
    if version >= 8:
        req = {"groups": [{"group_id": group, "member_id": None, "member_epoch": -1, "topics": topics}]}
    else:
        req = {"group_id": group, "topics": topics}
    body = g.offset_fetch(req, version, allows) if allows else g.offset_fetch(req, version)
    return readable(FETCH, body, [version])


# -- a group end to end ----------------------------------------------------------------------------------
def test_a_kafka_group_from_join_to_empty(env):
    (a, b), gen = stable(env.g, n=2)
    assert sorted(env.store().members("app")) == sorted([a, b])  # metaq sees the live members
    assert env.store().members("app", "orders") == []  # ... and its own consumers never balance with them
    data = env.zk.get(env.paths.group_member("app", a))[0]
    assert zk_groups.is_kafka_member(data) and json.loads(data)["broker"] == 5
    record, _ = zk_groups.read(env.zk, env.paths, "app")
    assert (record.generation, record.protocol, record.leader) == (gen, "range", a)
    assert {m.member_id: m.assignment for m in record.members} == {a: b"for " + a.encode(), b: b"for " + b.encode()}

    assert commit(env.g, "app", gen, a, {"orders": {0: 10, 1: 20}, "events": {0: 3}}) == \
        {("orders", 0): 0, ("orders", 1): 0, ("events", 0): 0}
    assert env.store().fetch("app", "orders") == {"5-0": 10, "5-1": 20}  # metaq's names, where metaq keeps them
    got = fetch(env.g, "app", [{"name": "orders", "partition_indexes": [1, 0, 7]}], version=7)
    assert got["error_code"] == 0
    assert [(p["partition_index"], p["committed_offset"], p["error_code"]) for p in got["topics"][0]["partitions"]] \
        == [(1, 20, 0), (0, 10, 0), (7, -1, 0)]
    every = fetch(env.g, "app", None, version=9)["groups"][0]
    assert {(t["name"], p["partition_index"], p["committed_offset"]) for t in every["topics"] for p in t["partitions"]} \
        == {("orders", 0, 10), ("orders", 1, 20), ("events", 0, 3)}

    left = env.g.leave_group({"group_id": "app", "members": [{"member_id": a, "group_instance_id": None},
                                                             {"member_id": b, "group_instance_id": None}]}, 5)
    assert [m["error_code"] for m in readable(LEAVE, left, [5])["members"]] == [0, 0]
    wait_until(lambda: env.store().members("app") == [], what="member nodes removed")
    wait_until(lambda: zk_groups.read(env.zk, env.paths, "app")[0].generation == gen + 1, what="empty record")
    assert zk_groups.read(env.zk, env.paths, "app")[0].members == ()
    assert env.store().fetch("app", "orders") == {"5-0": 10, "5-1": 20}  # offsets outlive the members


def test_offset_commit_refusals(env):
    snap = env.cache.snapshot()
    assert commit(env.g, "solo", -1, "", {"orders": {0: 5}}) == {("orders", 0): 0}  # no group management
    (a,), gen = stable(env.g)
    assert commit(env.g, "app", gen + 1, a, {"orders": {0: 1}}) == {("orders", 0): codes.ILLEGAL_GENERATION}
    assert commit(env.g, "app", gen, "stranger", {"orders": {0: 1}}) == {("orders", 0): codes.UNKNOWN_MEMBER_ID}
    assert commit(env.g, "app", -1, "", {"orders": {0: 1}}) == {("orders", 0): codes.UNKNOWN_MEMBER_ID}
    assert commit(env.g, "app", gen, a, {"nope": {0: 1}, "orders": {0: 1, 2: 1, 1: -1}}) == {
        ("nope", 0): codes.UNKNOWN_TOPIC_OR_PARTITION, ("orders", 0): 0, ("orders", 2): codes.UNKNOWN_TOPIC_OR_PARTITION,
        ("orders", 1): codes.INVALID_REQUEST}
    assert commit(env.g, "app", gen, a, {"orders": {1: 1}}, meta="x" * 4097) == {
        ("orders", 1): codes.OFFSET_METADATA_TOO_LARGE}
    assert env.store().fetch("app", "orders") == {"5-0": 1}  # only what was accepted
    no_topic = lambda op, kind, name: kind != "topic"  # noqa: E731
    assert commit(env.g, "app", gen, a, {"orders": {0: 9}}, allows=no_topic) == {
        ("orders", 0): codes.TOPIC_AUTHORIZATION_FAILED}
    no_group = lambda op, kind, name: kind != "group"  # noqa: E731
    assert commit(env.g, "app", gen, a, {"orders": {0: 9}}, allows=no_group) == {
        ("orders", 0): codes.GROUP_AUTHORIZATION_FAILED}
    assert env.store().fetch("app", "orders") == {"5-0": 1}
    by_id = commit(env.g, "app", gen, a, {"orders": {1: 7}, "x": {0: 1}}, version=10,
                   ids={"orders": snap.maps["orders"].topic_id, "x": b"\x07" * 16})
    assert by_id == {(snap.maps["orders"].topic_id, 1): 0, (b"\x07" * 16, 0): codes.UNKNOWN_TOPIC_ID}
    assert env.store().fetch("app", "orders") == {"5-0": 1, "5-1": 7}
    assert commit(env.g, "bad/group", -1, "", {"orders": {0: 1}}) == {("orders", 0): codes.INVALID_GROUP_ID}


def test_offset_fetch_refusals_and_versions(env):
    commit(env.g, "app", -1, "", {"orders": {0: 5}})
    old = fetch(env.g, "app", [{"name": "orders", "partition_indexes": [0]}], version=1,
                allows=lambda op, kind, name: kind != "group")
    assert old["topics"][0]["partitions"][0]["error_code"] == codes.GROUP_AUTHORIZATION_FAILED  # v1: per partition
    new = fetch(env.g, "app", [{"name": "orders", "partition_indexes": [0]}], version=8,
                allows=lambda op, kind, name: kind != "topic")
    assert new["groups"][0]["topics"][0]["partitions"][0]["error_code"] == codes.TOPIC_AUTHORIZATION_FAILED
    hidden = fetch(env.g, "app", None, version=8, allows=lambda op, kind, name: name != "orders")
    assert hidden["groups"][0]["topics"] == []  # all topics: those it may not see are left out
    snap = env.cache.snapshot()
    by_id = fetch(env.g, "app", [{"topic_id": snap.maps["orders"].topic_id, "partition_indexes": [0, 1]},
                                 {"topic_id": b"\x05" * 16, "partition_indexes": [0]}], version=10)["groups"][0]
    assert [(p["partition_index"], p["committed_offset"]) for p in by_id["topics"][0]["partitions"]] == [(0, 5), (1, -1)]
    assert by_id["topics"][1]["partitions"][0]["error_code"] == codes.UNKNOWN_TOPIC_ID
    assert fetch(env.g, "never", [{"name": "orders", "partition_indexes": [0]}], version=5)["topics"][0][
        "partitions"][0]["committed_offset"] == -1


# -- membership as ZooKeeper sees it ---------------------------------------------------------------------
def test_member_nodes_come_back_with_a_new_session(env):
    (a,), gen = stable(env.g)
    old = env.zk.client_id
    env.zk.restart()  # a new session: its ephemeral nodes are gone
    assert env.zk.client_id != old
    wait_until(lambda: env.store().members("app") == [a], what="member node made again")
    assert env.g.heartbeat({"group_id": "app", "generation_id": gen, "member_id": a}, 4)["error_code"] == 0


def test_a_group_metaq_consumers_use_is_refused_to_kafka_members(env):
    env.store().join("shared", "metaq-consumer-1", ["orders"])
    assert join(env.g, "shared").result(T)["error_code"] == codes.INCONSISTENT_GROUP_PROTOCOL
    assert readable(DELETE, env.g.delete_groups({"groups_names": ["shared"]}, 2), [2])["results"][0][
        "error_code"] == codes.NON_EMPTY_GROUP
    env.store().leave("shared", "metaq-consumer-1")
    assert join(env.g, "shared").result(T)["error_code"] == codes.MEMBER_ID_REQUIRED


def test_without_a_zookeeper_session_members_stay_and_changes_wait(env):
    """The broker's ZooKeeper session is away (its ``zk()`` gives None): heartbeats go on from memory,
    everything that must read or write ZooKeeper is answered COORDINATOR_NOT_AVAILABLE (clients retry), and
    closing does not wait for ZooKeeper."""
    away = {"now": False}
    g = KafkaGroups(lambda: None if away["now"] else env.zk, env.root, 5, env.cache.snapshot,
                    initial_rebalance_delay_ms=0).start()
    env.groups.append(g)
    (a,), gen = stable(g)
    away["now"] = True
    assert g.heartbeat({"group_id": "app", "generation_id": gen, "member_id": a}, 4)["error_code"] == 0
    assert commit(g, "app", gen, a, {"orders": {0: 1}}) == {("orders", 0): codes.COORDINATOR_NOT_AVAILABLE}
    assert join(g, "other").result(T)["error_code"] == codes.COORDINATOR_NOT_AVAILABLE  # not loaded: unknown
    assert join(g, "app", a).result(T)["error_code"] == codes.COORDINATOR_NOT_AVAILABLE  # metaq's members unseen
    away["now"] = False
    new = join(g, "app", a, metadata=b"v2").result(T)  # a rebalance ...
    away["now"] = True
    answer = g.sync_group({"group_id": "app", "generation_id": new["generation_id"], "member_id": a,
                           "assignments": [{"member_id": a, "assignment": b"x"}]}, 3).result(T)
    assert answer["error_code"] == codes.COORDINATOR_NOT_AVAILABLE
    assert fetch(g, "app", [{"name": "orders", "partition_indexes": [0]}], 7)["error_code"] == \
        codes.COORDINATOR_NOT_AVAILABLE
    away["now"] = False  # back: the member rejoins and the group settles
    again = join(g, "app", a, metadata=b"v2").result(T)
    assert g.sync_group({"group_id": "app", "generation_id": again["generation_id"], "member_id": a,
                         "assignments": [{"member_id": a, "assignment": b"y"}]}, 3).result(T)["assignment"] == b"y"
    assert commit(g, "app", again["generation_id"], a, {"orders": {0: 2}}) == {("orders", 0): 0}
    away["now"] = True
    started = time.monotonic()
    g.close()
    assert time.monotonic() - started < 3


# -- coordinators ----------------------------------------------------------------------------------------
def test_another_coordinator_takes_the_group_over_without_a_rebalance(env):
    (a, b), gen = stable(env.g, n=2)
    commit(env.g, "app", gen, a, {"orders": {0: 11}})
    other = env.new_groups()  # this broker restarted, or another one took the group over
    env.groups.append(other)
    assert other.heartbeat({"group_id": "app", "generation_id": gen, "member_id": b}, 4)["error_code"] == 0
    got = other.sync_group({"group_id": "app", "generation_id": gen, "member_id": b, "assignments": []}, 3).result(T)
    assert got["assignment"] == b"for " + b.encode()
    assert commit(other, "app", gen, a, {"orders": {0: 12}}) == {("orders", 0): 0}
    other.leave_group({"group_id": "app", "member_id": b}, 1)  # the new coordinator writes the record
    new = join(other, "app", a).result(T)
    assert new["generation_id"] == gen + 1
    assert other.sync_group({"group_id": "app", "generation_id": gen + 1, "member_id": a,
                             "assignments": [{"member_id": a, "assignment": b"all"}]}, 3).result(T)["error_code"] == 0
    # the old coordinator still believes in generation gen: its next write finds the record moved on
    env.g.leave_group({"group_id": "app", "member_id": b}, 1)
    stale = join(env.g, "app", a, metadata=b"changed").result(T)
    assert stale["generation_id"] == gen + 1  # (its own count)
    answer = env.g.sync_group({"group_id": "app", "generation_id": gen + 1, "member_id": a,
                               "assignments": [{"member_id": a, "assignment": b"x"}]}, 3).result(T)
    assert answer["error_code"] == codes.NOT_COORDINATOR
    assert not env.g.coordinator.has("app")


def test_groups_move_when_a_broker_joins(env, zookeeper):
    moving = next(g for g in (f"g{i}" for i in range(100)) if km.coordinator_of(g, [5, 6]) == 6)
    staying = next(g for g in (f"g{i}" for i in range(100)) if km.coordinator_of(g, [5, 6]) == 5)
    (a,), gen = stable(env.g, moving)
    (s,), sgen = stable(env.g, staying)
    b = member(env.g, moving)
    parked = join(env.g, moving, b)  # waits for a to rejoin
    assert not parked.done()
    env.regs.append(register(zookeeper, env.root, 6, {}))
    assert parked.result(T)["error_code"] == codes.NOT_COORDINATOR
    assert env.g.heartbeat({"group_id": moving, "generation_id": gen, "member_id": a}, 4)["error_code"] == \
        codes.NOT_COORDINATOR
    assert env.g.heartbeat({"group_id": staying, "generation_id": sgen, "member_id": s}, 4)["error_code"] == 0
    found = env.g.find_coordinator({"key_type": 0, "coordinator_keys": [moving, staying]}, 4)
    assert [(c["node_id"], c["host"], c["port"]) for c in found["coordinators"]] == [(6, "b6.test", 9006),
                                                                                    (5, "b5.test", 9005)]
    wait_until(lambda: env.store().members(moving) == [], what="the moved group's member nodes removed")


# -- whole groups ----------------------------------------------------------------------------------------
def test_list_describe_and_delete_groups(env):
    (a,), gen = stable(env.g)
    commit(env.g, "offsets-only", -1, "", {"orders": {0: 1}})
    listed = readable(LIST, env.g.list_groups({}, 4), range(0, 6))
    assert [(g["group_id"], g["protocol_type"], g["group_state"]) for g in listed["groups"]] == \
        [("app", "consumer", "Stable"), ("offsets-only", "", "Empty")]
    only_stable = env.g.list_groups({"states_filter": ["stable"]}, 4)
    assert [g["group_id"] for g in only_stable["groups"]] == ["app"]
    assert env.g.list_groups({"types_filter": ["consumer"]}, 5)["groups"] == []  # none of the new protocol
    seen = env.g.list_groups({}, 4, allows=lambda op, kind, name: kind == "group" and name == "app")
    assert [g["group_id"] for g in seen["groups"]] == ["app"]

    d = readable(DESCRIBE, env.g.describe_groups({"groups": ["app", "offsets-only", "ghost"]}, 5), range(0, 6))
    assert [(g["group_id"], g["error_code"], g["group_state"]) for g in d["groups"]] == \
        [("app", 0, "Stable"), ("offsets-only", 0, "Empty"), ("ghost", 0, "Dead")]
    assert [m["member_id"] for m in d["groups"][0]["members"]] == [a]
    d6 = readable(DESCRIBE, env.g.describe_groups({"groups": ["ghost"]}, 6), [6])["groups"][0]
    assert d6["error_code"] == codes.GROUP_ID_NOT_FOUND and "ghost" in d6["error_message"]
    refused = env.g.describe_groups({"groups": ["app"]}, 5, allows=lambda *a: False)["groups"][0]
    assert refused["error_code"] == codes.GROUP_AUTHORIZATION_FAILED

    def delete(*names, allows=None):
        body = env.g.delete_groups({"groups_names": list(names)}, 2, *([allows] if allows else []))
        return [r["error_code"] for r in readable(DELETE, body, range(0, 3))["results"]]

    assert delete("app", "ghost", "offsets-only") == [codes.NON_EMPTY_GROUP, codes.GROUP_ID_NOT_FOUND, codes.NONE]
    assert not env.store().exists("offsets-only")
    assert delete("app", allows=lambda *a: False) == [codes.GROUP_AUTHORIZATION_FAILED]
    env.g.leave_group({"group_id": "app", "member_id": a}, 0)
    assert delete("app") == [codes.NONE]
    assert not env.store().exists("app") and not env.g.coordinator.has("app")


# -- metaq groups shows a Kafka group -------------------------------------------------------------------
def test_metaq_groups_and_lag_metrics_show_a_kafka_groups_offsets(cluster, zookeeper):
    """... and `metaq groups delete` is refused while a Kafka member lives."""
    metrics_port = cluster.start_broker(1, settings={"metricsPort": 0}, topics={"orders": {"numPartitions": 2}}).metrics_port
    with cluster.client(Producer) as p:
        p.send_batch("orders", [b"m%d" % i for i in range(10)], partition="1-0")
        p.send_batch("orders", [b"n%d" % i for i in range(5)], partition="1-1")
    env = Env.__new__(Env)  # the coordinator is broker 5 (Kafka listener, no topics); the data is broker 1's
    env.zookeeper, env.root, env.paths = zookeeper, cluster.zk_root, ZkPaths(cluster.zk_root)
    env.zk = KazooClient(zookeeper.connect_string)
    env.zk.start(10)
    env.regs = [register(zookeeper, cluster.zk_root, 5, {})]
    env.cache = KafkaClusterCache(env.zk, cluster.zk_root)
    try:
        wait_until(lambda: "orders" in env.cache.snapshot().maps, what="orders numbered")
        env.groups = [env.new_groups()]
        tmap = env.cache.snapshot().maps["orders"]
        k0, k1 = tmap.number_of("1-0"), tmap.number_of("1-1")
        (a,), gen = stable(env.g, "kafka-readers")
        assert commit(env.g, "kafka-readers", gen, a, {"orders": {k0: 4, k1: 5}}) == {("orders", k0): 0,
                                                                                     ("orders", k1): 0}

        def metaq(*args):
            return cli.metaq_on(cluster, *args)

        r = metaq("groups", "kafka-readers")
        assert r.returncode == 0, r.stderr
        rows = sorted(line.split()[1:] for line in r.stdout.decode().splitlines()[1:])
        assert rows == [["orders", "1-0", "4", "10", "6"], ["orders", "1-1", "5", "5", "0"]]
        lag = wait_until(lambda: lag_samples(metrics_port, "kafka-readers"), what="lag of the Kafka group exported")
        assert lag == {"1-0": 6, "1-1": 0}
        r = metaq("groups", "delete", "--group", "kafka-readers")
        assert r.returncode == 1 and a.encode() in r.stderr  # a live Kafka member
        env.g.leave_group({"group_id": "kafka-readers", "member_id": a}, 2)
        wait_until(lambda: env.store().members("kafka-readers") == [], what="member node removed")
        r = metaq("groups", "delete", "--group", "kafka-readers")
        assert r.returncode == 0, r.stderr
        assert env.store().fetch("kafka-readers", "orders") == {}
    finally:
        env.close()


def lag_samples(port, group) -> dict:
    """{partition: metaq_consumergroup_lag} the broker exports for ``group``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["partition"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "metaq_consumergroup_lag" and s.labels.get("group") == group}
