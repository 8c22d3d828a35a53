"""Replicated groups under the faults users meet: a master frozen past its session timeout (fencing),
too few in-sync members for ``minInSyncReplicas`` (and ``acks=1``), a replica whose data directory was
wiped, a master that wrote past the high watermark before it died (divergence, truncation), an unclean
election, and a member restarted at once after a crash."""
import json
import os
import shutil
import signal
import time

import pytest

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.process import freeze
from metaq_broker.protocol.status import (BrokerUnavailableError, RemoteNotEnoughReplicasError,
                                          RemoteNotMasterError)
from conftest import wait_until
from test_replication_basic import in_sync_seen, log_bytes, read_all

pytestmark = pytest.mark.process

TOPICS = {"orders": {"numPartitions": 2}}


@pytest.fixture
def group(tmp_path, zookeeper, zk_root):
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3, topics=TOPICS).start()
    g.wait_master()
    g.wait_in_sync(range(3))
    yield g
    g.stop()


def clients(group, **kw):
    z = dict(zk_connect=group.zk_connect, zk_root=group.paths.root)
    return Producer(timeout=20.0, **z, **kw), Consumer(**z)


def uuid_of(member) -> str:
    return json.loads((member.workdir / "data" / "replication" / "member.json").read_text())["uuid"]


def test_a_frozen_master_is_fenced_and_rejoins(group):
    first = group.master_id()
    producer, consumer = clients(group)
    with producer, consumer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
        producer.send_batch("orders", [b"before-%d" % i for i in range(20)])
        old = group.members[first]
        freeze(old.proc.pid)  # past the 4 s session timeout: another member takes over
        second = group.wait_master(timeout=20, other_than=first)
        wait_until(lambda: producer.cluster.brokers().get(1) == group.members[second].address, what="new master seen")
        producer.send_batch("orders", [b"after-%d" % i for i in range(20)])
        os.kill(old.proc.pid, signal.SIGCONT)
        # the resumed process neither acknowledges nor serves: its lease ran out while it was frozen
        with Producer(brokers={1: old.address}, timeout=1.0) as stale, \
                Consumer(brokers={1: old.address}) as stale_reader:
            with pytest.raises((RemoteNotMasterError, BrokerUnavailableError)) as put_error:
                stale.send_batch("orders", [b"stale"], partition="1-0")
            assert "not master" in str(put_error.value)
            with pytest.raises(RemoteNotMasterError):
                stale_reader.fetch("orders", "1-0", 0)
        group.wait_in_sync(range(3))  # it rejoined as a replica
        assert group.master_id() == second
        seen = read_all(consumer)
        assert b"stale" not in seen and len(seen) == len(set(seen)) == 40


def test_min_insync_refuses_acks_all_and_acks_one_still_writes(tmp_path, zookeeper, zk_root):
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                    topics={"orders": {"numPartitions": 1, "minInSyncReplicas": 2}}).start()
    try:
        master = g.wait_master()
        g.wait_in_sync(range(3))
        others = [r for r in range(3) if r != master]
        z = dict(zk_connect=g.zk_connect, zk_root=g.paths.root)
        with Producer(timeout=2.0, **z) as producer, Producer(timeout=2.0, acks="1", **z) as fast, \
                Consumer(**z) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic routed")
            producer.send_batch("orders", [b"ok"])
            for r in others:
                g.members[r].kill()
            wait_until(lambda: [r for r, _ in g.state()["isr"]] == [master], timeout=20, what="in-sync set shrunk")
            # ZooKeeper holds the shrink a moment before the master's gate does: a put sent in between is
            # appended and then "not acknowledged, may or may not be stored" (a full run saw it), not refused
            wait_until(lambda: in_sync_seen(producer) == [master], what="the master saw the in-sync set shrink")
            end_before = consumer.offsets("orders")["1-0"][1]
            with pytest.raises(RemoteNotEnoughReplicasError) as refused:
                producer.send_batch("orders", [b"refused"])
            message = str(refused.value)
            assert "group 1" in message and "minInSyncReplicas=2" in message and f"[{master}]" in message
            fast.send_batch("orders", [b"one"])  # acks=1: the master alone
            wait_until(lambda: consumer.offsets("orders")["1-0"][1] == end_before + 1, what="acks=1 visible")
            g.members[others[0]].start()
            g.wait_in_sync([master, others[0]])
            wait_until(lambda: in_sync_seen(producer) == sorted([master, others[0]]), what="the master saw it join")
            Producer.send_batch(producer, "orders", [b"again"])
            assert sorted(read_all(consumer)) == [b"again", b"ok", b"one"]
    finally:
        g.stop()


def test_a_wiped_replica_copies_everything_and_rejoins_with_a_new_identity(group):
    master = group.master_id()
    victim = next(r for r in range(3) if r != master)
    producer, consumer = clients(group)
    with producer, consumer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
        for i in range(10):
            producer.send_batch("orders", [b"m-%d-%d" % (i, j) for j in range(50)])
        old_uuid = uuid_of(group.members[victim])
        group.members[victim].stop()
        shutil.rmtree(group.members[victim].workdir / "data")
        group.members[victim].start()
        new_uuid = uuid_of(group.members[victim])
        assert new_uuid != old_uuid
        wait_until(lambda: [victim, new_uuid] in group.state()["isr"], timeout=30, what="wiped member back in sync")
        producer.send_batch("orders", [b"late"])
        assert len(read_all(consumer)) == 501
    group.stop()
    logs = [log_bytes(m.workdir / "data") for m in group.members]
    assert logs[0] == logs[1] == logs[2]


def test_an_old_master_cuts_what_it_wrote_past_the_high_watermark(group):
    """The old master takes acks=1 puts while both replicas are frozen, dies, and comes back after a
    replica took over: it truncates exactly what nobody else had, and its log equals the new master's."""
    first = group.master_id()
    others = [r for r in range(3) if r != first]
    producer, consumer = clients(group)
    with producer, consumer:
        wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
        producer.send_batch("orders", [b"common-%d" % i for i in range(30)])
        for r in others:
            freeze(group.members[r].proc.pid)
        time.sleep(1.5)  # fetches in flight are answered (a long poll ends within 0.5 s) before the puts below
        with Producer(zk_connect=group.zk_connect, zk_root=group.paths.root, acks="1", timeout=5.0) as fast:
            fast.send_batch("orders", [b"lost-%d" % i for i in range(10)])  # on the master alone
        group.members[first].kill()
        for r in others:
            os.kill(group.members[r].proc.pid, signal.SIGCONT)
        second = group.wait_master(timeout=30, other_than=first)
        wait_until(lambda: producer.cluster.brokers().get(1) == group.members[second].address, what="new master seen")
        producer.send_batch("orders", [b"new-%d" % i for i in range(10)])
        group.members[first].start()
        group.wait_in_sync(range(3))
        seen = read_all(consumer)
        assert not any(v.startswith(b"lost-") for v in seen)
        assert sorted(v for v in seen if not v.startswith(b"lost-")) == sorted(
            [b"common-%d" % i for i in range(30)] + [b"new-%d" % i for i in range(10)])
        assert "truncated" in group.members[first].log_path.read_text()
    group.stop()
    logs = [log_bytes(m.workdir / "data") for m in group.members]
    assert logs[0] == logs[1] == logs[2]


def test_unclean_election_only_when_enabled(tmp_path, zookeeper, zk_root):
    """A group of two whose only in-sync member dies for good while the other is out of sync (frozen past
    replicaLagMaxMs): by default it stays without master and says why; restarted with uncleanElection=true
    the out-of-sync member takes over, the state says unclean, and what only the dead master had is lost."""
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2, topics=TOPICS,
                    settings={"replicaLagMaxMs": 1500}).start()
    try:
        master = g.wait_master()
        g.wait_in_sync(range(2))
        other = 1 - master
        producer, consumer = clients(g)
        with producer, consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
            producer.send_batch("orders", [b"both-%d" % i for i in range(20)])
            freeze(g.members[other].proc.pid)
            wait_until(lambda: [r for r, _ in g.state()["isr"]] == [master], timeout=20, what="replica left the set")
            producer.send_batch("orders", [b"alone-%d" % i for i in range(20)])  # acknowledged by the master alone
        g.members[master].kill()
        os.kill(g.members[other].proc.pid, signal.SIGCONT)
        wait_until(lambda: g.zk.exists(g.paths.group_replica(1, master)) is None, timeout=30,
                   what="the dead master's session expired")
        time.sleep(3 * 1.5)  # three times replicaLagMaxMs: an unclean election would have happened by now
        assert g.master_id() is None and g.state()["master"] == master
        with Producer(brokers={1: g.members[other].address}, timeout=1.0) as direct:
            with pytest.raises(RemoteNotMasterError) as refused:
                direct.send_batch("orders", [b"refused"], partition="1-0")
        message = str(refused.value)
        assert "group 1 has no master" in message and f"in-sync set [{master}]" in message
        assert "uncleanElection=false" in message

        g.members[other].stop()
        g.members[other].settings["uncleanElection"] = "true"
        g.members[other].start()
        assert g.wait_master(timeout=30) == other
        state = g.state()
        assert state["unclean"] and [r for r, _ in state["isr"]] == [other] and state["master"] == other
        assert "WITHOUT being in sync" in g.members[other].log_path.read_text()
        producer, consumer = clients(g)
        with producer, consumer:
            wait_until(lambda: producer.cluster.brokers().get(1) == g.members[other].address, what="new master seen")
            producer.send_batch("orders", [b"after-%d" % i for i in range(5)])
            seen = read_all(consumer)
        assert sorted(seen) == sorted([b"both-%d" % i for i in range(20)] + [b"after-%d" % i for i in range(5)])
    finally:
        for m in g.members:
            if m.proc is not None and m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
        g.stop()


def test_a_member_restarted_at_once_takes_over_its_own_stale_nodes(tmp_path, zookeeper, zk_root):
    """kill -9 then restart at once: the new process holds the data directory's lock, so the nodes the old
    session still holds are a dead run's: it deletes them and is master again without waiting for the
    session to expire. A copy of the data directory (same uuid, another lock) never takes over, and a second
    process on the same data directory is refused."""
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=1, topics=TOPICS,
                    settings={"zk.sessionTimeout": 10000}).start()
    try:
        assert g.wait_master() == 0
        m = g.members[0]
        producer, consumer = clients(g)
        with producer, consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
            producer.send_batch("orders", [b"before-%d" % i for i in range(20)])
            old_session = g.zk.exists(g.paths.broker(1)).ephemeralOwner
            epoch = g.state()["epoch"]
            m.kill()
            m.start()
            assert g.wait_master() == 0
            assert g.zk.exists(g.paths.broker(1)).ephemeralOwner != old_session and g.state()["epoch"] > epoch
            text = m.log_path.read_text()
            assert f"from ZooKeeper session 0x{old_session:x}" in text and "waiting for it to expire" not in text
            producer.send_batch("orders", [b"after-%d" % i for i in range(5)])
            assert len(read_all(consumer)) == 25

            owner = g.zk.exists(g.paths.broker(1)).ephemeralOwner
            keys = {k: v for k, v in m.settings.items() if k not in ("serverPort", "dataPath")}
            copy = BrokerProcess(tmp_path / "copy", 1, g.zk_connect, settings=keys)
            shutil.copytree(m.workdir / "data", tmp_path / "copy" / "data")
            with pytest.raises(RuntimeError, match="exited with code 2"):
                copy.start(timeout=60)
            assert "already registered" in copy.log_path.read_text()
            same = BrokerProcess(tmp_path / "same", 1, g.zk_connect,
                                 settings={k: v for k, v in m.settings.items() if k != "serverPort"})
            with pytest.raises(RuntimeError, match="exited with code 2"):
                same.start(timeout=60)
            assert "is in use by another running broker" in same.log_path.read_text()
            assert g.zk.exists(g.paths.broker(1)).ephemeralOwner == owner
            producer.send_batch("orders", [b"still-%d" % i for i in range(5)])
            assert len(read_all(consumer)) == 30
    finally:
        g.stop()


def test_zookeeper_gone_a_group_of_one_serves_on_a_replicated_master_refuses(tmp_path, own_zookeeper):
    """A broker that has only ever been its group's member needs no lease: nobody else can be elected, so
    it serves puts and reads through a ZooKeeper outage as a broker without replicas always did. The
    master of a group of three refuses once its lease runs out (another member might be elected); both
    serve again once ZooKeeper is back."""
    zk = own_zookeeper  # not the shared one: we stop it
    single = group = None
    try:
        single = BrokerProcess(tmp_path / "single", 1, zk.connect_string, settings={"zk.sessionTimeout": 4000},
                               topics=TOPICS).start()
        group = BrokerGroup(tmp_path / "group", 2, zk.connect_string, members=3, topics=TOPICS).start()
        group.wait_master()
        group.wait_in_sync(range(3))
        master = group.members[group.master_id()]
        with Producer(brokers={1: single.address}, timeout=5.0) as to_single, \
                Producer(brokers={2: master.address}, timeout=2.0) as to_group, \
                Consumer(brokers={1: single.address}) as from_single:
            to_single.send_batch("orders", [b"before"], partition="1-0")
            to_group.send_batch("orders", [b"before"], partition="2-0")
            zk.stop()
            time.sleep(0.75 * 4.0 + 1.0)  # past the replicated master's lease
            to_single.send_batch("orders", [b"during"], partition="1-0")
            assert from_single.fetch("orders", "1-0", 0).batch.column("value").to_pylist() == [b"before", b"during"]
            with pytest.raises((RemoteNotMasterError, BrokerUnavailableError), match="not master"):
                to_group.send_batch("orders", [b"refused"], partition="2-0")
            zk.start()
        z = dict(zk_connect=zk.connect_string, zk_root="/meta")
        with Producer(timeout=30.0, **z) as producer, Consumer(**z) as consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 4, timeout=30,
                       what="both groups registered again")
            producer.send_batch("orders", [b"after"], partition="1-0")
            producer.send_batch("orders", [b"after"], partition="2-0")
            assert sorted(read_all(consumer)) == [b"after", b"after", b"before", b"before", b"during"]
    finally:
        for b in (single, group):
            if b is not None:
                b.stop()
        zk.stop()
