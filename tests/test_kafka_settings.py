"""The broker's Kafka settings (``kafkaPort``, ``advertisedHostName``) and the address a broker registers for
Kafka clients: checked at load naming the key, ``host`` in the master node (``brokers/metaq/ids/<b>``) is the
advertised name for every listener, ``kafkaPort`` is there only while a Kafka listener is up (a real broker, a real ZooKeeper,
read back through the cache Metadata is answered from)."""
import json

import pytest
from conftest import wait_until
from kazoo.client import KazooClient

from metaq_broker.errors import ConfigError
from metaq_broker.server import kafka_metadata as km
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load
from metaq_broker.zk import kafka_partitions
from metaq_broker.zk.kafka_cluster import KafkaBroker, KafkaClusterCache
from metaq_broker.zk.paths import ZkPaths

pytestmark = pytest.mark.unit


def test_defaults_and_values():
    cfg = load(None)
    assert (cfg.kafka_port, cfg.advertised_host_name, cfg.advertised_host) == (9092, None, "127.0.0.1")
    cfg = load(None, {"hostName": "0.0.0.0", "advertisedHostName": "broker-1.example", "kafkaPort": "-1"})
    assert (cfg.kafka_port, cfg.advertised_host) == (-1, "broker-1.example")
    assert load(None, {"kafkaPort": "0"}).kafka_port == 0


@pytest.mark.parametrize("overrides,match", [
    ({"kafkaPort": "-2"}, "kafkaPort: -2 is outside -1..65535"),
    ({"kafkaPort": "65536"}, "kafkaPort: 65536 is outside"),
    ({"kafkaPort": "kafka"}, "kafkaPort: 'kafka' is not an integer"),
    ({"advertisedHostName": " "}, "advertisedHostName: must not be empty"),
    ({"advertisedHostName": "0.0.0.0"}, "advertisedHostName: '0.0.0.0' means every address"),
    ({"advertisedHostName": "::"}, "advertisedHostName: '::' means every address"),
])
def test_bad_values_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(None, overrides)


@pytest.fixture
def zk(zookeeper):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(15)
    yield client
    client.stop()
    client.close()


def start(tmp_path, zookeeper, zk_root, kafka_port=-1, **settings):
    overrides = {"brokerId": 4, "serverPort": 0, "dataPort": 0, "kafkaPort": kafka_port,
                 "zk.connect": zookeeper.connect_string, "zk.root": zk_root, "zk.sessionTimeout": 4000,
                 "dataPath": tmp_path / "b", **settings}
    return Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()


def test_the_registered_address_is_the_advertised_one(tmp_path, zookeeper, zk_root, zk):
    broker = start(tmp_path, zookeeper, zk_root, advertisedHostName="localhost")
    try:
        info = json.loads(zk.get(ZkPaths(zk_root).broker(4))[0])
        assert (info["host"], info["port"], info["dataPort"]) == ("localhost", broker.port, broker.data_port)
        assert "kafkaPort" not in info and broker.kafka_port is None  # kafkaPort=-1: no listener, no Kafka address
        broker.create_topic("orders", 2, {})
        cache = KafkaClusterCache(zk, zk_root)
        try:
            snap = wait_until(lambda: (s := cache.snapshot()).maps.get("orders") and s, what="orders numbered")
            assert snap.maps["orders"].partitions == ("4-0", "4-1") and snap.live == {4} and snap.brokers == {}
            assert km.topic_entry(snap, "orders")["partitions"][0]["leader_id"] == -1  # no listener: offline
        finally:
            cache.close()
    finally:
        broker.stop(grace=0)


def test_a_kafka_listener_port_is_registered_with_the_advertised_host(tmp_path, zookeeper, zk_root, zk):
    broker = start(tmp_path, zookeeper, zk_root, kafka_port=0, advertisedHostName="localhost", numPartitions=1)
    assert broker.kafka_port > 0  # kafkaPort=0: any free port, the one the listener took is registered
    cache = KafkaClusterCache(zk, zk_root)
    try:
        broker.create_topic("orders", 1, {})
        snap = wait_until(lambda: (s := cache.snapshot()).maps.get("orders") and s.brokers and s,
                          what="broker and topic in the cache")
        assert snap.brokers == {4: KafkaBroker(4, "localhost", broker.kafka_port)}
        meta = km.metadata(snap, [{"name": "orders"}])
        assert [(b["node_id"], b["host"], b["port"]) for b in meta["brokers"]] == [(4, "localhost", broker.kafka_port)]
        p = meta["topics"][0]["partitions"][0]
        assert (p["leader_id"], p["leader_epoch"], p["error_code"]) == (4, snap.epochs[4], 0) and snap.epochs[4] >= 1
        assert meta["cluster_id"] == kafka_partitions.cluster_id(zk, ZkPaths(zk_root))
    finally:
        cache.close()
        broker.stop(grace=0)
