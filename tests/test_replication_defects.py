"""Issue 24's defects of replicated groups, each reproduced with real processes (and, for the lock order
and the fetcher's fencing, the real broker and fetcher in this process) and kept as a test that fails
without its fix: acks=all acknowledged with one copy (1), ZooKeeper losing its data (2), a ZooKeeper
restart duplicating puts (3), a deposed master's late answers (4), the lock-order deadlock (5), a replica
that must start over after retention (6), a frozen master stalling the group (7), a producer stuck on a
frozen master (8), and the session timeout ZooKeeper negotiates (Also check). Defect 9 (a single broker's
in-doubt transactions after a restart) is in test_replication_txn_restart.py. The producers here are not
idempotent (``idempotent=False``): the tests look at the broker's own answers, which an idempotent producer
would send again (tests/test_idempotent_producer.py covers those)."""
import json
import os
import shutil
import signal
import socket
import threading
import time
import uuid as uuid_module

import pytest

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools import process
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.zookeeper import free_port
from metaq_broker.net.blocking import read_replica_reply
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import replication as rp
from metaq_broker.protocol.status import (BrokerUnavailableError, RemoteNotAcknowledgedError,
                                          RemoteNotEnoughReplicasError, RemoteNotMasterError)
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.server.replica_fetcher import ReplicaFetcher
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.zk import groups as zk_groups
from metaq_broker.zk.session import negotiated_timeout, new_client, start_client
from conftest import wait_until
from test_replication_basic import Load, log_bytes, read_all
from zk_loss import wipe

pytestmark = pytest.mark.process

TOPICS = {"orders": {"numPartitions": 2}}
STRICT = {"orders": {"numPartitions": 2, "minInSyncReplicas": 2}}


def freeze(member) -> None:
    process.freeze(member.proc.pid)


def thaw(member) -> None:
    os.kill(member.proc.pid, signal.SIGCONT)


def zk_args(group) -> dict:
    return dict(zk_connect=group.zk_connect, zk_root=group.paths.root)


def described_latest(member) -> dict:
    """{partition name: latest} as the member itself answers DescribeTopic (no routing to the master)."""
    with Consumer(brokers={1: member.address}) as direct:
        reply = direct.pool.get(member.address).call("DescribeTopic", pb.TopicRequest(topic="orders"))
    return {p.name: p.latest for p in reply.partitions}


def isr_of(group) -> list:
    state = group.state()
    return [r for r, _ in state["isr"]] if state else []


@pytest.fixture
def strict_group(tmp_path, zookeeper, zk_root):
    """Three members, orders with minInSyncReplicas=2, every member in sync."""
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3, topics=STRICT).start()
    g.wait_master()
    g.wait_in_sync(range(3))
    yield g
    g.stop()


# -- 1: acks=all acknowledged with one copy ------------------------------------------------------------

def test_acks_all_is_never_acknowledged_by_the_master_alone(strict_group):
    """Both replicas frozen: a put waiting for them is not acknowledged once the in-sync set shrinks below
    minInSyncReplicas ("may or may not be stored"), though the HW over the master alone passes it; after
    the shrink, acks=all puts, transactional puts and the prepare of a transaction begun before are refused
    before anything is written."""
    g = strict_group
    master = g.master_id()
    others = [r for r in range(3) if r != master]
    with Producer(idempotent=False, timeout=20.0, **zk_args(g)) as producer, \
            Producer(idempotent=False, timeout=2.0, **zk_args(g)) as quick, \
            Consumer(**zk_args(g)) as consumer:
        for p in (producer, quick):
            wait_until(lambda p=p: len(p.cluster.topic_partitions("orders")) == 2, what="topic routed")
        producer.send_batch("orders", [b"both"], partition="1-0")
        txn = quick.transaction("defect1")
        txn.send_batch("orders", [b"in-txn"], partition="1-1")
        for r in others:
            freeze(g.members[r])
        try:
            with pytest.raises(RemoteNotAcknowledgedError) as e:
                producer.send_batch("orders", [b"master-only"], partition="1-0")
            assert "may or may not be stored" in str(e.value) and "minInSyncReplicas=2" in str(e.value)
            assert isr_of(g) == [master]
            with pytest.raises(RemoteNotEnoughReplicasError, match="nothing was written"):
                quick.send_batch("orders", [b"refused"], partition="1-0")
            with pytest.raises(RemoteNotEnoughReplicasError, match="nothing was written"):
                quick.transaction("defect1-late").send_batch("orders", [b"refused-txn"], partition="1-0")
            with pytest.raises(RemoteNotEnoughReplicasError, match="nothing was written"):
                txn.prepare()
        finally:
            for r in others:
                thaw(g.members[r])
        g.wait_in_sync(range(3))
        txn.prepare()
        txn.commit()
        producer.send_batch("orders", [b"again"], partition="1-0")
        seen = read_all(consumer)
    assert b"refused" not in seen and b"refused-txn" not in seen
    assert {b"both", b"in-txn", b"again"} <= set(seen)


# -- 7 and 8: a frozen master; 4: its late answers -----------------------------------------------------

def test_a_frozen_master_neither_stalls_the_group_nor_keeps_a_producer_nor_feeds_a_replica(strict_group):
    """The master is frozen (SIGSTOP) past its session. (8) A put already sent to it over the data port
    ends when the new master is registered, instead of at the producer's timeout. (7) The replica that
    was fetching from it follows the new master at once, so with minInSyncReplicas=2 acks=all puts are
    acknowledged again within the producer's 15 s (the replica's socket used to wait 30 s). (4) Replica
    fetches it was long-polling on when it froze are answered ``not master:`` once it resumes, not with
    the data a replica would take."""
    g = strict_group
    old = g.master_id()
    member = g.members[old]
    replica = next(r for r in range(3) if r != old)
    uuid = json.loads((g.members[replica].workdir / "data" / "replication" / "member.json").read_text())["uuid"]
    with Producer(idempotent=False, timeout=60.0, **zk_args(g)) as stuck, \
            Producer(idempotent=False, timeout=15.0, **zk_args(g)) as fresh, \
            Consumer(**zk_args(g)) as consumer:
        for p in (stuck, fresh):
            wait_until(lambda p=p: len(p.cluster.topic_partitions("orders")) == 2 and p.data_address(1),
                       what="topic and data port routed")
        stuck.send_batch("orders", [b"before"], partition="1-0")
        epoch = g.state()["epoch"]
        ends = {name: bounds[2] for name, bounds in consumer.offset_bounds("orders").items()}
        node = json.loads(g.zk.get(g.paths.group_replica(1, old))[0])
        socks = [socket.create_connection((node["host"], int(node["dataPort"])), timeout=30) for _ in range(8)]

        def fetch_at_end(applied: int) -> bytes:  # as the replica asks when it has everything
            return rp.pack_request(rp.FetchRequest(epoch, replica, bytes.fromhex(uuid), applied, 500, 1 << 20, [
                rp.PartitionFetch("orders", p, ends[f"1-{p}"], ends[f"1-{p}"], epoch if ends[f"1-{p}"] else 0)
                for p in range(2)]))
        socks[0].sendall(fetch_at_end(-1))
        applied = read_replica_reply(socks[0])[0].journal_last_seq
        for sock in socks:
            sock.sendall(fetch_at_end(applied))  # nothing new: the master long-polls up to 0.5 s on each
        time.sleep(0.1)  # the master holds them all now
        freeze(member)
        outcome: dict = {}

        def put_to_the_frozen_master():
            try:
                stuck.send_batch("orders", [b"sent-to-frozen"], partition="1-0")
                outcome["ok"] = True
            except Exception as e:  # noqa: BLE001 - what the test looks at
                outcome["error"] = e

        t = threading.Thread(target=put_to_the_frozen_master, daemon=True)
        t.start()
        try:
            g.wait_master(timeout=30, other_than=old)
            t.join(timeout=20)
            assert not t.is_alive(), "the put to the frozen master still waits after the new master came"
            error = outcome["error"]
            assert isinstance(error, BrokerUnavailableError) and "moved" in str(error) and \
                "may or may not be stored" in str(error)
            fresh.send_batch("orders", [b"after"], partition="1-0")  # within the producer's 15 s timeout
            thaw(member)
            heads = [read_replica_reply(sock)[0] for sock in socks]
            assert all(h.status != 0 and h.message.startswith("not master:") for h in heads), heads
        finally:
            thaw(member)
            for sock in socks:
                sock.close()
        g.wait_in_sync(range(3))
        seen = read_all(consumer)
        # (Finding 9 of the nemesis) The deposed master, now a replica, reports the group's latest offsets,
        # not its old high watermark for as long as it runs.
        fresh.send_batch("orders", [b"later"], partition="1-1")
        latest = {name: bounds[1] for name, bounds in consumer.offset_bounds("orders").items()}
        wait_until(lambda: described_latest(member) == latest, timeout=20,
                   what=f"the deposed master's DescribeTopic at the group's latest offsets {latest}")
    assert {b"before", b"after"} <= set(seen) and len(seen) == len(set(seen))
    g.stop()
    logs = [log_bytes(m.workdir / "data") for m in g.members]
    assert logs[0] == logs[1] == logs[2]


def test_a_paused_fetcher_applies_nothing_more(tmp_path, zookeeper, zk_root):
    """(4) The replica's side of fencing: once ``pause()`` (promotion) or ``stop()`` returns, no reply
    from the master it followed enters the log, although the master keeps answering under load. Ten
    rounds of follow, copy, pause against a real master; the old fetcher applied the reply it was waiting
    for after pause had returned."""
    g = BrokerGroup(tmp_path / "g", 1, zookeeper.connect_string, zk_root, members=1, topics=TOPICS).start()
    stop = threading.Event()
    try:
        g.wait_master()
        master = zk_groups.master_node(g.zk, g.paths, 1)
        epoch = g.state()["epoch"]
        with Producer(idempotent=False, acks="1", **zk_args(g)) as producer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")

            def load():
                i = 0
                while not stop.is_set():
                    producer.send_batch("orders", [b"x" * 200] * 200, partition=f"1-{i % 2}")
                    i += 1

            threading.Thread(target=load, daemon=True).start()
            for round_ in range(10):
                store = MessageStore(tmp_path / f"replica-{round_}", {"orders": TopicConfig(num_partitions=2)},
                                     background_interval=None)
                fetcher = ReplicaFetcher(store, None, 7, uuid_module.uuid4().hex, sync_topics=lambda m, l: 0,
                                         on_fenced=lambda e: None, fetch_timeout_s=3.0)
                try:
                    fetcher.follow(epoch, master)
                    wait_until(lambda: sum(p.log_end_offset for p in store.all_partitions()) > 2000,
                               what="the fetcher copying")
                    fetcher.pause()
                    end = [p.log_end_offset for p in store.all_partitions()]
                    fetcher.stop()  # joins its thread: a reply it was still waiting for is in, or not, by now
                    assert [p.log_end_offset for p in store.all_partitions()] == end, f"round {round_}"
                finally:
                    fetcher.stop()
                    store.close()
    finally:
        stop.set()
        g.stop()


# -- 3: a ZooKeeper restart duplicates puts ------------------------------------------------------------

def test_a_zookeeper_restart_stores_no_put_twice(tmp_path, own_zookeeper):
    """Four acks=all producers while ZooKeeper is down past the master's lease, twice: puts stored when
    the lease ran out used to be refused with ``not master:`` and resent (one duplicate per producer per
    restart). Now they are ``not acknowledged``; nothing is stored twice, nothing acknowledged is lost."""
    zk = own_zookeeper
    g = BrokerGroup(tmp_path / "g", 1, zk.connect_string, "/meta", members=3, topics=TOPICS).start()
    writers = []
    try:
        g.wait_master()
        g.wait_in_sync(range(3))
        with Producer(idempotent=False, **zk_args(g)) as p:
            wait_until(lambda: len(p.cluster.topic_partitions("orders")) == 2, what="topic routed")
        # acks=all puts of unique values one after another; a failed one (it may or may not be stored) is
        # never resent by the test
        writers = [Load(Producer(idempotent=False, timeout=30.0, **zk_args(g)), b"w%d" % i) for i in range(4)]
        for w in writers:
            w.start()
        for _ in range(2):
            for w in writers:
                w.progress(10)
            zk.stop()
            time.sleep(4.5)  # longer than the lease (0.75 x 4 s): puts in flight when it runs out
            zk.start()
            for w in writers:
                w.progress(10)  # writes resume once ZooKeeper is back
    finally:
        for w in writers:
            w.finish()
            w.producer.close()
    try:
        with Consumer(**zk_args(g)) as consumer:
            seen = read_all(consumer)
    finally:
        g.stop()
    twice = sorted(v for v in set(seen) if seen.count(v) > 1)
    assert not twice, f"stored twice: {twice[:10]}"
    lost = {v for w in writers for v in w.acked} - set(seen)
    assert not lost, f"acknowledged, lost: {sorted(lost)[:10]}"


# -- 2: ZooKeeper loses its data -----------------------------------------------------------------------

def test_zookeeper_losing_its_data_loses_nothing_acknowledged(tmp_path, own_zookeeper):
    """Member 2 is stopped, 500 acks=all puts are acknowledged by members 0 and 1, all stop, ZooKeeper's
    data is wiped and the member with nothing of them starts first: it must not be elected (it used to be,
    and the others truncated to it: 500 of 500 lost); it says whom it waits for. Once 0 and 1 are back the
    most advanced of them is master of an epoch above every earlier one, and nothing is lost. Then
    ZooKeeper is wiped again while all run, members and clients: the group elects again, above every
    epoch, losing nothing, and the clients write and read on."""
    zk = own_zookeeper
    g = BrokerGroup(tmp_path / "g", 1, zk.connect_string, "/meta", members=3, topics=TOPICS).start()
    try:
        g.wait_master()
        g.wait_in_sync(range(3))
        master = g.master_id()
        lagging = next(r for r in range(3) if r != master)
        g.members[lagging].stop()
        wait_until(lambda: lagging not in isr_of(g), timeout=30, what="the stopped member left the in-sync set")
        with Producer(idempotent=False, timeout=30.0, **zk_args(g)) as producer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
            acked = [b"m-%d" % i for i in range(500)]
            for i in range(0, 500, 5):
                producer.send_batch("orders", acked[i:i + 5])
        epoch = g.state()["epoch"]
        for m in g.members:
            if m.proc is not None and m.proc.poll() is None:
                m.stop()
        wipe(zk)
        g.members[lagging].start()
        time.sleep(3.0)  # longer than the bootstrap grace: it would have stood by now
        assert g.master_id() is None
        with Producer(brokers={1: g.members[lagging].address}, idempotent=False, timeout=1.0) as direct:
            with pytest.raises(RemoteNotMasterError) as refused:
                direct.send_batch("orders", [b"refused"], partition="1-0")
        assert "ZooKeeper has no state" in str(refused.value) and "not back with their data" in str(refused.value)
        for r in range(3):
            if r != lagging:
                g.members[r].start()
        second = g.wait_master(timeout=30)
        assert second != lagging and g.state()["epoch"] > epoch and not g.state()["unclean"]
        g.wait_in_sync(range(3), timeout=60)
        with Consumer(**zk_args(g)) as consumer:
            seen = read_all(consumer)
        assert sorted(seen) == sorted(acked)

        epoch = g.state()["epoch"]
        # Clients opened before, kept open: their sessions are refused by the emptied ZooKeeper too, and
        # are replaced after a session timeout of refusals (nemesis finding 8, clients).
        with Producer(idempotent=False, timeout=30.0, **zk_args(g)) as producer, Consumer(**zk_args(g)) as consumer:
            wait_until(lambda: len(producer.cluster.topic_partitions("orders")) == 2, what="topic routed")
            wipe(zk)  # while every member runs
            g.wait_master(timeout=60)
            assert g.state()["epoch"] > epoch
            g.wait_in_sync(range(3), timeout=60)
            producer.send_batch("orders", [b"after"])  # waits for the topics to be registered again
            assert sorted(read_all(consumer)) == sorted(acked + [b"after"])
    finally:
        g.stop()
    logs = [log_bytes(m.workdir / "data") for m in g.members]
    assert logs[0] == logs[1] == logs[2]


def test_the_lease_follows_the_session_timeout_zookeeper_grants(zookeeper):
    """(Also check) The shared ZooKeeper (tickTime 500 ms) grants at most 10 s: a client asking for 15 s
    gets 10, and that is what a master's lease must be measured against; one asking for 4 s gets 4."""
    for asked, granted in ((15.0, 10.0), (4.0, 4.0)):
        client = new_client(zookeeper.connect_string, session_timeout=asked)
        start_client(client, zookeeper.connect_string, 15)
        try:
            assert negotiated_timeout(client) == pytest.approx(granted)
        finally:
            client.stop()
            client.close()


def test_a_master_granted_a_shorter_session_leases_by_it(tmp_path, zookeeper, zk_root):
    """A member asking for 15 s is granted 10 s by ZooKeeper: it says so, and as master, frozen for 8 s (past
    0.75 x 10 s, within 0.75 x 15 s, before ZooKeeper expires the session), it finds its lease run out once
    resumed and stops being master (it may well be elected again at once: its session lives)."""
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2, topics=TOPICS,
                    settings={"zk.sessionTimeout": 15000}).start()
    try:
        master = g.wait_master()
        g.wait_in_sync(range(2))
        m = g.members[master]
        wait_until(lambda: "ZooKeeper granted a session timeout of 10s" in m.log_path.read_text(),
                   what="the granted timeout told")
        freeze(m)
        time.sleep(8.0)  # the fault: past 0.75 x 10 s, before ZooKeeper expires its session (10 s)
        thaw(m)
        wait_until(lambda: "its lease ran out" in m.log_path.read_text(), timeout=10,
                   what="the master stepping down: its lease ran out")
    finally:
        g.stop()


# -- 5: the lock-order deadlock ------------------------------------------------------------------------

def test_the_group_thread_and_a_replica_fetch_take_their_locks_in_one_order(tmp_path, zookeeper, zk_root):
    """The deadlock: the group thread, holding the group's lock, steps down and takes the replica
    manager's condition, while a data-port thread, holding that condition in a replica fetch, wanted the
    group's lock to write an in-sync change. Here the master runs in this process: the test holds the
    group's lock (as the group thread does in a step) while a replica catches up, then steps the manager
    down: it must not wait on the fetch thread."""
    port, data_port = free_port(), free_port()
    config = load(None, {"brokerId": "1", "replicaId": "0", "hostName": "127.0.0.1", "serverPort": str(port),
                         "kafkaPort": "0", "dataPort": str(data_port), "dataPath": str(tmp_path / "m0"),
                         "zk.connect": zookeeper.connect_string, "zk.root": zk_root, "zk.sessionTimeout": "4000",
                         "replicaLagMaxMs": "3000"})
    master = Broker(config).start()
    replica = None
    try:
        assert master.group.wait_role(10) == "master"
        with master.group._lock:  # the group thread, in the middle of a step
            replica = BrokerProcess(tmp_path / "m1", 1, zookeeper.connect_string,
                                    settings={"zk.root": zk_root, "zk.sessionTimeout": 4000, "replicaId": 1,
                                              "replicaLagMaxMs": 3000, "dataPort": 0}).start()
            wait_until(lambda: master.replicas.progress.get(1) is not None and
                       master.replicas.progress[1].last_caught_up > 0, what="the replica caught up")
            stepping_down = threading.Thread(target=master.replicas.deactivate, daemon=True)
            stepping_down.start()
            stepping_down.join(timeout=10)
            assert not stepping_down.is_alive(), "stepping down waited on a replica fetch: lock-order deadlock"
    finally:
        if replica is not None:
            replica.stop()
        master.stop()


# -- 6: a replica that must start over after retention -------------------------------------------------

@pytest.mark.parametrize("wiped", [False, True], ids=["stopped", "wiped"])
def test_a_replica_behind_the_masters_retention_starts_over_and_rejoins(tmp_path, zookeeper, zk_root, wiped):
    """Member 1 is stopped; the master writes on while retention removes every segment member 1 has (and
    the segment of the group's first epoch marker). Back, member 1 starts over at the master's earliest
    offset and rejoins the in-sync set, logging a few lines, not a flood (it used to be told its log parted
    from the master's after every reset, forever, writing 55 MB of log in 45 s). Also when its data
    directory was wiped meanwhile (the nemesis found that: its new log is another log than the master's,
    and it started over at the earliest offset without the epoch there, parting from the master's again
    after every copy)."""
    topics = {"orders": {"numPartitions": 1, "maxSegmentSize": 16384, "retentionBytes": 40000}}
    g = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=2, topics=topics,
                    settings={"retentionCheckInterval": 1}).start()
    try:
        master = g.wait_master()
        g.wait_in_sync(range(2))
        other = 1 - master
        with Producer(idempotent=False, acks="1", **zk_args(g)) as producer, Consumer(**zk_args(g)) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("orders"), what="topic routed")
            producer.send_batch("orders", [b"a" * 100] * 50)
            g.wait_in_sync(range(2))
            g.members[other].stop()
            end = consumer.offsets("orders")["1-0"][1]
            for _ in range(40):
                producer.send_batch("orders", [b"b" * 100] * 50)
            wait_until(lambda: consumer.offsets("orders")["1-0"][0] > end + 100, timeout=30,
                       what="retention past the stopped member's end")
            if wiped:
                shutil.rmtree(g.members[other].workdir / "data")
            g.members[other].start()
            g.wait_in_sync(range(2), timeout=30)
            producer.send_batch("orders", [b"c" * 100] * 10)
        text = g.members[other].log_path.read_text()
        assert text.count("starting the partition over") <= 2
        assert text.count("truncated") <= 2 and len(text) < 200_000
    finally:
        g.stop()
