"""In-process parts of Kafka's admin APIs: a broker's settings as DescribeConfigs answers them (secrets
never among the values), what CreatePartitions asks of a broker (kafka_admin.partitions_to_add), and a
store growing a topic (MessageStore.add_partitions): the partitions it has kept, the new ones empty,
never shrunk, the count kept across a reopen."""
from __future__ import annotations

import pytest

from metaq_broker.errors import InvalidTopicError
from metaq_broker.protocol.kafka import codes
from metaq_broker.server.config import load
from metaq_broker.server.kafka_admin import Refused, broker_settings, describe_configs_entries, partitions_to_add
from metaq_broker.store import MessageStore, TopicConfig
from metaq_broker.zk.kafka_cluster import ClusterSnapshot
from metaq_broker.zk.kafka_partitions import TopicMap

pytestmark = pytest.mark.unit

SECRET = "pw-8c1e-Xylo"


def test_every_setting_is_there_and_no_secret_is_a_value():
    cfg = load(None, {"zk.auth": f"digest:metaq:{SECRET}", "zk.client.auth": f"digest:client:{SECRET}2",
                      "numPartitions": "4", "advertisedHostName": "broker-1.example", "kafkaPort": "0"})
    settings = {s.name: s for s in broker_settings(cfg, 19092)}
    assert SECRET not in repr(list(settings.values()))
    assert SECRET not in repr(describe_configs_entries(list(settings.values()), None))
    for key in ("zk.auth", "zk.client.auth", "replication.sasl.password"):
        assert settings[key].sensitive and settings[key].value is None
    assert not settings["zk.auth"].default and settings["replication.sasl.password"].default  # set / not set
    assert settings["advertised.listeners"].value == "PLAINTEXT://broker-1.example:19092"  # the bound port
    assert settings["num.partitions"].value == settings["numPartitions"].value == "4"
    assert settings["kafkaPort"].value == "0"
    # every [system] key of config.py is described (a new key is not forgotten silently)
    from metaq_broker.security.settings import BROKER_KEYS, BROKER_ZK_KEYS, ZK_KEYS
    from metaq_broker.server.config import SYSTEM_KEYS, TOPIC_KEYS
    assert set(SYSTEM_KEYS) | set(TOPIC_KEYS) | set(BROKER_KEYS) | set(ZK_KEYS) | set(BROKER_ZK_KEYS) <= set(settings)
    entries = describe_configs_entries(list(settings.values()), ["zk.auth", "num.partitions", "nope"])
    assert [(e["name"], e["value"], e["is_sensitive"]) for e in entries] == [("num.partitions", "4", False),
                                                                             ("zk.auth", None, True)]


def _snap(partitions: tuple, here: dict) -> ClusterSnapshot:
    maps = {"t": TopicMap("t", bytes(range(16)), partitions)} if partitions else {}
    return ClusterSnapshot("c", frozenset(here), {}, {}, {"t": here} if here else {}, maps)


def test_partitions_to_add_counts_every_number_ever_given_and_names_what_it_refuses():
    snap = _snap(("1-0", "2-0", "3-0"), {1: 1, 2: 1})  # broker 3 was forgotten: its number stays
    assert partitions_to_add(snap, "t", 5, None, 1, 1) == 2
    assert partitions_to_add(snap, "t", 4, None, 4, None) == 1  # broker 4 lacks the topic
    cases = [((snap, "t", 2, None, 1, 1), codes.INVALID_PARTITIONS, "has 3 partitions, more than the 2"),
             ((snap, "t", 3, None, 1, 1), codes.INVALID_PARTITIONS, "has 3 partitions already"),
             ((snap, "t", 5, [[1], [2]], 1, 1), codes.INVALID_REQUEST, "manual assignments"),
             ((snap, "t", 5, None, 1, 2), codes.LEADER_NOT_AVAILABLE, "still being published"),
             ((snap, "u", 5, None, 1, None), codes.UNKNOWN_TOPIC_OR_PARTITION, "unknown topic 'u'"),
             ((_snap((), {1: 1}), "t", 5, None, 1, 1), codes.LEADER_NOT_AVAILABLE, "no Kafka partition numbers")]
    for args, code, words in cases:
        with pytest.raises(Refused, match=words) as e:
            partitions_to_add(*args)
        assert e.value.code == code


def test_a_store_grows_a_topic_keeping_what_it_has(tmp_path):
    store = MessageStore(tmp_path, {"t": TopicConfig(num_partitions=2)}, background_interval=None)
    try:
        store.append("t", 1, [b"old"])
        assert store.add_partitions("t", 4).num_partitions == 4
        assert store.add_partitions("t", 4).num_partitions == 4  # as many: nothing changes
        with pytest.raises(InvalidTopicError, match="has 4 partitions; a topic does not shrink"):
            store.add_partitions("t", 3)
        assert [p.log_end_offset for p in store.partitions("t")] == [0, 1, 0, 0]
        store.append("t", 3, [b"new"])
    finally:
        store.close()
    store = MessageStore(tmp_path, {"t": TopicConfig(num_partitions=2)}, background_interval=None)  # the old INI
    try:
        assert store.topic_config("t").num_partitions == 4
        assert [p.log_end_offset for p in store.partitions("t")] == [0, 1, 0, 1]
    finally:
        store.close()
