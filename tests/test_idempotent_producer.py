"""The idempotent producer against real broker processes: a put whose answer is lost (the connection cut
after the broker stored it, or the broker killed and restarted) is sent again and stored exactly once;
duplicates, gaps and fenced epochs are refused with errors naming producer, partition and sequences; a
replicated group's master killed with kill -9 under an idempotent producer loses and doubles nothing.
``Producer(idempotent=False)`` keeps the old rule (never resent), shown beside."""
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer
from metaq_broker.devtools.broker_process import BrokerProcess
from metaq_broker.devtools.group import BrokerGroup
from metaq_broker.devtools.process import freeze
from metaq_broker.devtools.zookeeper import free_port
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import records
from metaq_broker.protocol.status import (STORED_NOTHING, BrokerUnavailableError, RemoteNotAcknowledgedError,
                                          RemoteOutOfOrderSequenceError, RemoteProducerFencedError)
from conftest import process_states, wait_until

pytestmark = pytest.mark.process


class CuttingProxy:
    """A TCP proxy in front of a broker's gRPC port. Armed, it lets the next put through to the broker,
    waits until ``stored()`` says the broker has it, and then cuts the connection instead of forwarding
    the answer: the client never learns the put's outcome."""

    def __init__(self, target_port: int, stored):
        self.port, self.target, self.stored = free_port(), target_port, stored
        self.armed = threading.Event()
        self.cuts = 0
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the broker is down: as a refused connection to it would be
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, answers):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if answers and self.armed.is_set() and self.stored():
                    self.armed.clear()
                    self.cuts += 1
                    break  # the answer (or whatever the broker sends once it stored the put) is dropped
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self._stop = True
        self._server.close()


@pytest.fixture
def broker(tmp_path):
    b = BrokerProcess(tmp_path / "b", 1, topics={"t": {"numPartitions": 1}}).start()
    yield b
    b.kill()


def log_end(address: str) -> int:
    with Consumer(brokers={1: address}) as c:
        return c.offset_bounds("t", ["1-0"])["1-0"][2]


def read_values(address: str) -> list:
    with Consumer(brokers={1: address}) as c:
        end = c.offsets("t", ["1-0"])["1-0"][1]
        return c.read_range("t", "1-0", 0, end).column("value").to_pylist() if end else []


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_put_whose_answer_is_lost_is_stored_once(broker, idempotent):
    proxy = CuttingProxy(broker.port, lambda: log_end(broker.address) >= 2)
    try:
        with Producer(brokers={1: f"127.0.0.1:{proxy.port}"}, use_data_port=False, timeout=15.0,
                      idempotent=idempotent) as producer:
            producer.send_batch("t", [b"first"], partition="1-0")
            proxy.armed.set()
            if idempotent:
                result = producer.send_batch("t", [b"second"], partition="1-0")[0]
                assert result.duplicate and result.base_offset == 1  # the broker had it: its first offsets
                producer.send_batch("t", [b"third"], partition="1-0")
            else:
                with pytest.raises(BrokerUnavailableError):  # may or may not be stored: not resent
                    producer.send_batch("t", [b"second"], partition="1-0")
        assert proxy.cuts == 1
        assert read_values(broker.address) == ([b"first", b"second", b"third"] if idempotent else [b"first", b"second"])
    finally:
        proxy.close()


def test_a_put_cut_off_by_a_broker_restart_is_stored_once(broker):
    """The broker stores the put, is killed (kill -9) before it answers and comes back: the producer's
    resend finds the batch in the state the broker rebuilt from its log."""
    def stored_then_kill():
        if log_end(broker.address) >= 1:
            broker.kill()
            return True
        return False
    proxy = CuttingProxy(broker.port, stored_then_kill)
    restarted = threading.Thread(target=lambda: (wait_until(lambda: proxy.cuts, what="cut"), broker.start()))
    try:
        with Producer(brokers={1: f"127.0.0.1:{proxy.port}"}, use_data_port=False, timeout=30.0) as producer:
            producer.send_batch("t", [b"warm up"], partition="1-0")  # the producer id, before the cut
            proxy.stored = lambda: stored_then_kill() if log_end(broker.address) >= 2 else False
            proxy.armed.set()
            restarted.start()
            result = producer.send_batch("t", [b"cut off"], partition="1-0")[0]
            assert result.base_offset == 1 and result.duplicate
        restarted.join()
        assert read_values(broker.address) == [b"warm up", b"cut off"]
    finally:
        proxy.close()


def test_a_data_port_put_to_a_broker_killed_before_answering_is_sent_again(cluster):
    """The data port's put went into the socket of a frozen broker, which is then killed and restarted:
    the idempotent producer sends it again to the restarted broker (its state rebuilt from the log)."""
    b = cluster.start_broker(1, {"dataPort": 0}, topics={"t": {"numPartitions": 1}})
    with cluster.client(Producer, timeout=30) as producer:
        wait_until(lambda: producer.data_address(1) and producer.partitions("t"), what="broker in the cluster view")
        producer.send_batch("t", [b"first"], partition="1-0")
        freeze(b.proc.pid)
        try:
            put = producer.start_put("t", "1-0", records.encode_body([b"cut off"]))
        finally:
            b.proc.kill()
            b.proc.wait(10)
        restart = threading.Thread(target=lambda: cluster.start_broker(1, {"dataPort": 0},
                                                                       topics={"t": {"numPartitions": 1}}))
        restart.start()
        assert put.result().base_offset == 1
        restart.join()
        assert producer.send_batch("t", [b"next"], partition="1-0")[0].base_offset == 2
    assert read_values(cluster.brokers[1].address) == [b"first", b"cut off", b"next"]


def test_a_later_sequence_stored_first_does_not_refuse_an_earlier_one_never_stored(broker):
    """Two threads' first puts to a partition race: the one stamped sequence 1 reaches the broker first,
    which knows nothing of the producer yet and takes it (as Kafka does: the producer's state may have
    expired). Sequence 0 then comes "before the batches kept": refused as a duplicate though never stored
    (stop 38's run: ``RemoteDuplicateSequenceError`` from a plain ``send_batch``). The producer knows it
    never stored it and sends it again with the next sequence: both stored, each once."""
    with Producer(brokers={1: broker.address}, timeout=15.0) as producer:
        held, sent = threading.Event(), threading.Event()
        put_once = producer.put_once

        def hold_sequence_0(topic, name, body, xid="", stamp=None, deadline=None):
            if stamp is not None and stamp[2] == 0 and not sent.is_set():
                sent.set()
                assert held.wait(15)
            return put_once(topic, name, body, xid, stamp, deadline)
        producer.put_once = hold_sequence_0
        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(producer.send_batch, "t", [b"stamped 0"], partition="1-0")
            assert sent.wait(15)
            assert producer.send_batch("t", [b"stamped 1"], partition="1-0")[0].base_offset == 0
            held.set()
            result = late.result(30)[0]
        assert result.base_offset == 1 and not result.duplicate
        assert producer.send_batch("t", [b"next"], partition="1-0")[0].base_offset == 2
    assert read_values(broker.address) == [b"stamped 1", b"stamped 0", b"next"]


def test_gaps_and_old_epochs_are_refused_by_name(broker):
    with Producer(brokers={1: broker.address}, timeout=5.0) as producer:
        producer.send_batch("t", [b"a"], partition="1-0")
        pid, epoch = producer.producer_id, producer.producer_epoch
        body = records.encode_body([b"gap"])
        with pytest.raises(RemoteOutOfOrderSequenceError,
                           match=rf"producer {pid} \(epoch {epoch}\) in partition t-0: got sequences 5-5, expected 1"):
            producer.put_once("t", "1-0", body, "", (pid, epoch, 5)).result()
        bumped = producer.call(1, "InitProducerId", pb.InitProducerIdRequest(producer_id=pid, producer_epoch=epoch))
        assert (bumped.producer_id, bumped.producer_epoch) == (pid, epoch + 1)
        producer.put_once("t", "1-0", records.encode_body([b"new epoch"]), "", (pid, epoch + 1, 0)).result()
        with pytest.raises(RemoteProducerFencedError, match=rf"producer {pid} \(epoch {epoch}\).*fenced"):
            producer.put_once("t", "1-0", records.encode_body([b"old"]), "", (pid, epoch, 1)).result()
        other = producer.call(1, "InitProducerId", pb.InitProducerIdRequest())
        assert other.producer_id != pid and other.producer_epoch == 0
    assert read_values(broker.address) == [b"a", b"new epoch"]


def test_producer_ids_are_unique_across_brokers_and_restarts(cluster):
    cluster.start_broker(1, topics={"t": {}})
    cluster.start_broker(2, topics={"t": {}})
    with cluster.client(Producer) as producer:
        wait_until(lambda: len(producer.cluster.brokers()) == 2, what="both brokers")
        ids = [producer.call(b, "InitProducerId", pb.InitProducerIdRequest()).producer_id for b in (1, 2) * 3]
        cluster.brokers[1].kill()
        cluster.start_broker(1, topics={"t": {}})
        wait_until(lambda: 1 in producer.cluster.brokers(), what="broker 1 back")
        ids.append(producer.call(1, "InitProducerId", pb.InitProducerIdRequest(), retries=5).producer_id)
    assert len(set(ids)) == len(ids)


def test_producer_ids_in_use_are_never_given_out_again_after_zookeeper_lost_them(cluster):
    """ZooKeeper loses the last producer id block (its data wiped): a broker restarted after that, and a new
    broker that knows nothing, give out ids above every id the first broker's partitions keep state for. An
    id given out again would make the new producer's first batch look like the old producer's stored one:
    acknowledged as a duplicate and never written."""
    from kazoo.client import KazooClient
    from metaq_broker.zk.paths import ZkPaths
    cluster.start_broker(1, topics={"t": {}})
    with cluster.client(Producer) as first:
        wait_until(lambda: first.cluster.topic_partitions("t"), what="topic routed")
        first.send_batch("t", [b"old producer"])
        old_id = first.producer_id
    zk = KazooClient(hosts=cluster.zk_connect)
    zk.start()
    try:
        zk.delete(ZkPaths(cluster.zk_root).producer_id_block())  # what a ZooKeeper that lost its data has
        cluster.brokers[1].kill()
        cluster.start_broker(1, topics={"t": {}})
        cluster.start_broker(2, topics={"u": {}})
        with cluster.client(Producer) as producer:
            wait_until(lambda: len(producer.cluster.brokers()) == 2, what="both brokers")
            fresh = [producer.call(b, "InitProducerId", pb.InitProducerIdRequest(), retries=5).producer_id
                     for b in (2, 1)]
        assert min(fresh) > old_id, (fresh, old_id)
        with cluster.client(Producer) as second:
            wait_until(lambda: second.cluster.topic_partitions("t"), what="topic routed")
            second.send_batch("t", [b"new producer"])
            assert second.producer_id > old_id
    finally:
        zk.stop()
        zk.close()
    assert read_values(cluster.brokers[1].address) == [b"old producer", b"new producer"]


def test_a_group_master_killed_under_an_idempotent_producer_loses_and_doubles_nothing(tmp_path, zookeeper, zk_root):
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                        topics={"t": {"numPartitions": 2}}).start()
    try:
        first = group.wait_master()
        group.wait_in_sync(range(3))
        z = dict(zk_connect=group.zk_connect, zk_root=group.paths.root)
        acked, errors, stop = [], [], threading.Event()

        def produce():
            with Producer(timeout=30.0, **z) as producer:
                wait_until(lambda: len(producer.cluster.topic_partitions("t")) == 2, what="topic")
                i = 0
                while not stop.is_set() and i < 5000:
                    batch = [b"m-%06d" % (i + j) for j in range(20)]
                    try:
                        producer.send_batch("t", batch, keys=batch)
                        acked.extend(batch)
                    except Exception as e:  # noqa: BLE001 - counted: an idempotent producer should see none
                        errors.append(e)
                    i += 20

        thread = threading.Thread(target=produce)
        thread.start()
        wait_until(lambda: len(acked) >= 400, timeout=60, what="acknowledged puts before the kill")
        os.kill(group.members[first].proc.pid, signal.SIGKILL)
        group.wait_master(timeout=30, other_than=first)
        wait_until(lambda: len(acked) >= 1600, timeout=60, what="acknowledged puts after the failover")
        stop.set()
        thread.join(120)
        assert not errors, errors[:3]
        with Consumer(**z) as consumer:
            seen = []
            for p in ("1-0", "1-1"):
                end = consumer.offsets("t", [p])[p][1]
                seen += consumer.read_range("t", p, 0, end).column("value").to_pylist()
        assert len(seen) == len(set(seen)), "duplicates"
        assert set(acked) <= set(seen), "acknowledged messages lost"
    finally:
        group.stop()


def test_a_put_left_in_doubt_is_never_reported_as_stored_nothing(tmp_path, zookeeper, zk_root, caplog):
    """Both replicas frozen under minInSyncReplicas=2: the master stores an idempotent acks=all put and
    answers ``not acknowledged`` once the in-sync set shrinks; the producer sends it again and every resend
    is refused ``not enough in-sync replicas ... nothing was written``, true of the resend only. At the
    producer's timeout the put must fail as may-or-may-not-be-stored (it used to fail with the last
    refusal, which tells an application it may send the messages again: a duplicate once the replicas
    are back), and within that timeout. Thawed, the group has the put, once."""
    group = BrokerGroup(tmp_path, 1, zookeeper.connect_string, zk_root, members=3,
                        topics={"t": {"numPartitions": 1, "minInSyncReplicas": 2}}).start()
    try:
        master = group.wait_master()
        group.wait_in_sync(range(3))
        z = dict(zk_connect=group.zk_connect, zk_root=group.paths.root)
        replicas = [m for r, m in enumerate(group.members) if r != master]
        with Producer(timeout=8.0, **z) as producer, Consumer(**z) as consumer:
            wait_until(lambda: producer.cluster.topic_partitions("t"), what="topic routed")
            producer.send_batch("t", [b"before"])
            for m in replicas:
                freeze(m.proc.pid)
            try:
                began = time.monotonic()
                caplog.set_level(logging.INFO, logger="metaq_broker.client")  # its resends, should this fail
                try:
                    acked = producer.send_batch("t", [b"in doubt"])
                    failed = None
                except BrokerUnavailableError as e:
                    failed = e
                took = time.monotonic() - began
                assert failed is not None, (f"acknowledged ({acked}) after {took:.2f} s with both replicas frozen; "
                                            f"their states: {process_states(m.proc.pid for m in replicas)} "
                                            f"(T: stopped); the master's log: {group.members[master].log_path}")
            finally:
                for m in replicas:
                    os.kill(m.proc.pid, signal.SIGCONT)
            assert not isinstance(failed, STORED_NOTHING), failed
            assert isinstance(failed, RemoteNotAcknowledgedError), failed
            assert "may or may not be stored" in str(failed) and "nothing was written" in str(failed)
            assert took < 8.0 + 1.0, f"the put took {took:.1f} s, over the producer's timeout of 8 s"
            group.wait_in_sync(range(3), timeout=30)
            producer.send_batch("t", [b"after"])
            end = consumer.offsets("t", ["1-0"])["1-0"][1]
            seen = consumer.read_range("t", "1-0", 0, end).column("value").to_pylist()
        assert seen.count(b"in doubt") == 1 and seen[-1] == b"after", seen
    finally:
        group.stop()
