"""A client's view of the cluster follows ZooKeeper losing its data (``zk/watches.py``).

After a wipe ZooKeeper counts zxids from the start again. (1) A broker node written again there with the
``mzxid`` the old one had and another address used to go unseen: kazoo's DataWatch calls back only when
the mzxid moved, so a producer sent to a member that was no longer master until its timeout (it failed
so in ``test_zookeeper_losing_its_data_loses_nothing_acknowledged``). (2) A root missing when the client's
new session started (no broker had written it again yet) was never followed again: brokers and topics
registered later were not seen at all. The nodes are written here by the test, standing in for brokers,
so that the zxids can be lined up; ZooKeeper and the clients are real."""
from __future__ import annotations

import json

import pytest

from conftest import wait_until
from metaq_broker.client.cluster import ClusterView
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import new_client, start_client
from zk_loss import NewSession, pad_to, wipe

pytestmark = pytest.mark.process


def _broker(port: int) -> bytes:
    return json.dumps({"host": "127.0.0.1", "port": port}).encode()


def test_a_view_follows_nodes_written_again_after_zookeeper_lost_its_data(own_zookeeper):
    zk = own_zookeeper
    same, late = ZkPaths("/same"), ZkPaths("/late")
    writer = new_client(zk.connect_string)
    start_client(writer, zk.connect_string, 15)
    for p in (same, late):
        writer.ensure_path(p.broker_ids())
        writer.ensure_path(p.topics())
    for i in range(40):  # room for the writes after the wipe below: the new node's mzxid can be the old one's
        writer.create(f"/pad-{i}", b"")
    writer.create(same.broker(1), _broker(1111))
    old_mzxid = writer.exists(same.broker(1)).mzxid
    writer.stop()
    writer.close()
    views = {name: ClusterView(zk.connect_string, p.root) for name, p in (("same", same), ("late", late))}
    try:
        sessions = {name: NewSession(v.zk) for name, v in views.items()}
        wait_until(lambda: views["same"].brokers() == {1: "127.0.0.1:1111"}, what="the view follows broker 1")

        wipe(zk)
        writer = new_client(zk.connect_string)
        start_client(writer, zk.connect_string, 15)
        writer.ensure_path(same.broker_ids())
        pad_to(writer, old_mzxid)
        writer.create(same.broker(1), _broker(2222))  # another master, at the old node's mzxid
        assert writer.exists(same.broker(1)).mzxid == old_mzxid, "the zxids did not line up"
        for s in sessions.values():  # refused for a session timeout, then a new session (zk/session.py)
            assert s.connected.wait(60), "the view never started a new session"

        wait_until(lambda: views["same"].brokers() == {1: "127.0.0.1:2222"}, timeout=10,
                   what=f"the view at broker 1's new address (it says {views['same'].brokers()})")

        assert views["late"].brokers() == {} and views["late"].topics() == []
        writer.ensure_path(late.topic("t"))  # its roots, written once the view's new session started
        writer.ensure_path(late.broker_ids())
        writer.create(f"{late.topic('t')}/2-m", json.dumps({"numPartitions": 3}).encode())
        writer.create(late.broker(2), _broker(3333))
        wait_until(lambda: views["late"].brokers() == {2: "127.0.0.1:3333"} and views["late"].topics() == ["t"]
                   and views["late"].topic_partitions("t") == [(2, 0), (2, 1), (2, 2)], timeout=10,
                   what=f"the view finding broker 2 and topic t registered after its new session "
                        f"(it says {views['late'].brokers()}, topics {views['late'].topics()})")
        writer.stop()
        writer.close()
    finally:
        for v in views.values():
            v.close()
