"""The broker's ZooKeeper caches (SCRAM users, ACLs, Kafka metadata) follow nodes written again after ZooKeeper lost its data.

After a wipe ZooKeeper counts zxids from the start again, and kazoo's TreeCache tells of a changed node only
when its ``mzxid`` moved: a user re-created with a new password at the mzxid the old node had used to keep
its old credential (``zk/users.py``), and a broker's new Kafka address went unseen (``zk/kafka_cluster.py``).
The nodes are written here by the test, so that the zxids can be lined up (as in
``test_cluster_view_zk_loss.py``); ZooKeeper and the caches are real."""
from __future__ import annotations

import json

import pytest

from conftest import wait_until
from metaq_broker.security.acl import Acl
from metaq_broker.security.scram import Credential
from metaq_broker.zk.acls import AclCache, add_acls
from metaq_broker.zk.kafka_cluster import KafkaBroker, KafkaClusterCache
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client, start_client
from metaq_broker.zk.users import UserCache, put_user
from zk_loss import NewSession, pad_to, wipe

pytestmark = pytest.mark.process

ROOT = "/wiped"
PATHS = ZkPaths(ROOT)


def _broker(kafka_port: int) -> bytes:
    return json.dumps({"host": "127.0.0.1", "port": 1, "kafkaPort": kafka_port}).encode()


def _writer(zk):
    """A new session that has made the parents of the three nodes (and so none of the nodes' zxids)."""
    writer = new_client(zk.connect_string)
    start_client(writer, zk.connect_string, 15)
    for path in (PATHS.users(), PATHS.acl_pattern_type("topic", "literal"), PATHS.broker_ids()):
        writer.ensure_path(path)
    return writer


def _write(writer, password: str, acl: Acl, kafka_port: int) -> list:
    """User alice, the ACLs of topic orders and broker 1, one transaction each, in this order: their mzxids."""
    put_user(writer, ROOT, "alice", Credential.make(password, salt=password.encode()))
    add_acls(writer, ROOT, [acl])
    writer.create(PATHS.broker(1), _broker(kafka_port))
    return [writer.exists(p).mzxid for p in (PATHS.user("alice"), PATHS.acl_resource("topic", "literal", "orders"),
                                              PATHS.broker(1))]


def test_the_caches_follow_nodes_written_again_at_their_old_mzxid_after_zookeeper_lost_its_data(own_zookeeper):
    zk = own_zookeeper
    old_acl, new_acl = (Acl("User:alice", "Allow", "Read", "topic", "orders"),
                        Acl("User:bob", "Allow", "Write", "topic", "orders"))
    writer = _writer(zk)
    for i in range(40):  # room for the writes after the wipe below: the nodes' mzxids can be the old ones
        writer.create(f"/pad-{i}", b"")
    old_zxids = _write(writer, "old-password", old_acl, 9092)
    assert old_zxids == list(range(old_zxids[0], old_zxids[0] + 3))
    writer.stop()
    writer.close()

    client = new_client(zk.connect_string)  # the caches' session, as a broker's
    start_client(client, zk.connect_string, 15)
    session = NewSession(client)
    acls, changed = [None], []
    users = UserCache(client, ROOT)
    users.listen(changed.append)
    acl_cache = AclCache(client, ROOT, lambda held: acls.__setitem__(0, held))
    kafka = KafkaClusterCache(client, ROOT)
    try:
        assert users.credential("alice") == Credential.make("old-password", salt=b"old-password")
        assert acls[0] == [old_acl]
        assert kafka.snapshot().brokers == {1: KafkaBroker(1, "127.0.0.1", 9092)}

        wipe(zk)
        writer = _writer(zk)
        pad_to(writer, old_zxids[0])
        assert _write(writer, "new-password", new_acl, 9093) == old_zxids, "the zxids did not line up"
        writer.stop()
        writer.close()
        assert session.connected.wait(60), "the caches' client never started a new session"  # zk/session.py

        new_user = Credential.make("new-password", salt=b"new-password")

        def stale():
            return [name for name, fresh in (
                ("users", users.credential("alice") == new_user),
                ("acls", acls[0] == [new_acl]),
                ("kafka", kafka.snapshot().brokers == {1: KafkaBroker(1, "127.0.0.1", 9093)})) if not fresh]

        try:
            wait_until(lambda: not stale(), timeout=10, what="the caches holding the nodes written after the wipe")
        except AssertionError:
            raise AssertionError(f"caches still holding the data from before the wipe: {stale()}") from None
        assert "alice" in changed, "the user cache's listeners were not told that alice changed"
    finally:
        users.close()
        acl_cache.close()
        kafka.close()
        client.stop()
        client.close()
