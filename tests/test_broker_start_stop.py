"""A broker's start and stop undo the same parts in the same order (server/broker.py, ``Broker.STAGES``):
a start that fails at any stage, by an injected failure right after the stage or by a real fault inside
one (a port taken, the data directory locked by another broker), leaves no thread, port, lock,
ZooKeeper session or node behind, and a broker started right after on the same ports and data comes up
and serves. A real ZooKeeper with ACLs on (its own session for users and ACLs), the data port and the
metrics port, so that every stage has something to undo."""
import fcntl
import os
import socket
import threading

import pytest
from conftest import wait_until
from kazoo.client import KazooClient
from test_metrics import port_is_free

from metaq_broker.client import Admin
from metaq_broker.errors import ConfigError
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.server.member import DIRECTORY as MEMBER_DIRECTORY


class Injected(Exception):
    pass


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def setup(tmp_path, zookeeper, zk_root):
    grpc_port, data_port, metrics_port, kafka_port = free_ports(4)
    settings = {"brokerId": 7, "serverPort": grpc_port, "dataPort": data_port, "metricsPort": metrics_port,
                "kafkaPort": kafka_port,
                "zk.connect": zookeeper.connect_string, "zk.root": zk_root, "zk.sessionTimeout": 6000,
                "dataPath": tmp_path / "data", "authorizer": "acl", "super.users": "User:ANONYMOUS"}
    zk = KazooClient(zookeeper.connect_string)
    zk.start()
    yield settings, (grpc_port, data_port, metrics_port, kafka_port), zk
    zk.stop()
    zk.close()


def config(settings):
    return load(None, {k: str(v) for k, v in settings.items()})


def ephemeral_nodes(zk, path):
    """Every ephemeral node below ``path`` (a live session's)."""
    found = []
    if not zk.exists(path):
        return found
    for child in zk.get_children(path):
        node = f"{path}/{child}"
        if zk.exists(node).ephemeralOwner:
            found.append(node)
        found += ephemeral_nodes(zk, node)
    return found


def lock_is_free(data_path):
    path = data_path / MEMBER_DIRECTORY / "lock"
    if not path.exists():
        return True
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def assert_nothing_left(before, ports, zk, settings):
    wait_until(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()], timeout=30,
               what=f"no thread left: {[t.name for t in threading.enumerate() if t not in before]}")
    for port in ports:
        assert port_is_free(port), port
    assert lock_is_free(settings["dataPath"])
    assert ephemeral_nodes(zk, settings["zk.root"]) == []


def assert_a_broker_starts_after(settings):
    broker = Broker(config(settings)).start()
    try:
        with Admin(brokers={7: broker.address}) as admin:
            admin.create_topic("after", 1)
            assert "after" in admin.topics()
    finally:
        broker.stop(grace=1)


@pytest.mark.parametrize("stage", Broker.STAGES)
def test_a_start_that_fails_after_any_stage_leaves_nothing_behind(setup, monkeypatch, stage):
    settings, ports, zk = setup
    before = set(threading.enumerate())
    original = getattr(Broker, f"_start_{stage}")

    def failing(self, stack):
        original(self, stack)
        raise Injected(stage)
    monkeypatch.setattr(Broker, f"_start_{stage}", failing)
    with pytest.raises(Injected):
        Broker(config(settings)).start()
    monkeypatch.undo()
    assert_nothing_left(before, ports, zk, settings)
    assert_a_broker_starts_after(settings)
    assert_nothing_left(before, ports, zk, settings)


@pytest.mark.parametrize("taken", ["serverPort", "dataPort", "metricsPort"])
def test_a_port_taken_refuses_the_start_and_leaves_nothing_behind(setup, taken):
    settings, ports, zk = setup
    before = set(threading.enumerate())
    squatter = socket.create_server(("127.0.0.1", settings[taken]))
    try:
        with pytest.raises(ConfigError, match=rf"{taken}: cannot listen on 127.0.0.1:{settings[taken]}|"
                                              rf"metrics port"):
            Broker(config(settings)).start()
    finally:
        squatter.close()
    assert_nothing_left(before, ports, zk, settings)
    assert_a_broker_starts_after(settings)


def test_a_data_directory_in_use_refuses_the_start_and_leaves_the_owner_alone(setup):
    settings, ports, zk = setup
    owner = Broker(config(settings)).start()
    try:
        before = set(threading.enumerate())
        other = dict(settings, brokerId=8, serverPort=0, dataPort=0, metricsPort=0)
        with pytest.raises(ConfigError, match="is in use by another running broker"):
            Broker(config(other)).start()
        wait_until(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()],
                   what="no thread left by the refused start")
        assert not lock_is_free(settings["dataPath"])  # still the owner's
        with Admin(brokers={7: owner.address}) as admin:  # the owner serves on
            admin.create_topic("still", 1)
            assert "still" in admin.topics()
    finally:
        owner.stop(grace=1)
    assert_nothing_left(before, ports, zk, settings)


def test_stop_undoes_a_full_start(setup):
    settings, ports, zk = setup
    before = set(threading.enumerate())
    broker = Broker(config(settings)).start()
    assert zk.exists(f"{settings['zk.root']}/brokers/ids/7")
    broker.stop(grace=1)
    broker.stop(grace=1)  # twice is harmless
    assert_nothing_left(before, ports, zk, settings)


def test_health_says_serving_only_once_the_start_has_ended(setup, monkeypatch):
    """Docker's HEALTHCHECK and the entrypoint's ``health`` ask gRPC's health service: it must not answer
    SERVING while later stages still start (gRPC's HealthServicer says SERVING for "" by default, and the
    gRPC server serves from the serving stage on)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    settings, (grpc_port, *_), _ = setup
    held, release = threading.Event(), threading.Event()
    real = Broker._start_resolver

    def slow_resolver(self, stack):  # the last stage waits until the test has asked
        held.set()
        release.wait(30)
        real(self, stack)

    monkeypatch.setattr(Broker, "_start_resolver", slow_resolver)
    broker = Broker(config(settings))
    starting = threading.Thread(target=broker.start)
    starting.start()
    try:
        assert held.wait(30), "the start never reached its last stage"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            release.set()
            starting.join(30)
            assert check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        starting.join(30)
        broker.stop()


@pytest.mark.process
def test_a_test_brokers_chosen_port_taken_before_its_start_is_chosen_again(tmp_path):
    """``BrokerProcess`` picks a free port, then starts the broker on it; with tests in parallel another
    process may take the port in between (CI: "serverPort: cannot listen ... Address already in use"). A
    port it chose is chosen again; one the caller gave is not (the caller meant that port)."""
    from metaq_broker.devtools.broker_process import BrokerProcess

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        chosen = BrokerProcess(tmp_path / "chosen", 1)
        chosen.port = chosen.settings["serverPort"] = taken  # as if another process took it meanwhile
        try:
            chosen.start()
            assert chosen.port != taken
        finally:
            chosen.kill()
        given = BrokerProcess(tmp_path / "given", 2, port=taken)
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{taken}"):
            given.start()
        given.kill()


@pytest.mark.process
def test_a_test_brokers_ports_and_readiness_come_from_this_runs_log_line(tmp_path):
    """``BrokerProcess.start`` returns once this run's "listening on" line is written, and reads the ports
    the broker chose (``metricsPort``/``metaqPort`` 0) from it: after a restart, not from the run before,
    whose line is still in the log (ready_by_log returned at once on a restart, before the broker listened)."""
    from metaq_broker.devtools.broker_process import BrokerProcess

    b = BrokerProcess(tmp_path / "b", 1, settings={"metricsPort": 0, "metaqPort": 0})
    try:
        for ready_by_log in (False, True, True):
            b.start(ready_by_log=ready_by_log)
            ports = (b.metrics_port, b.metaq_port, b.kafka_port)
            assert None not in ports
            for port in ports:  # this run's: something listens there now
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            assert b.stop() == 0
            assert all(port_is_free(port) for port in ports)
    finally:
        b.kill()
