"""Replication's configuration (issue 14, plan steps 15-17): the new keys and their refusals, the topic
override carried through runtime topics and DescribeTopic, PutRaw's acks flag, and member.json."""
import json
import re
from contextlib import closing

import pytest

from metaq_broker.client.connection import BrokerConnection
from metaq_broker.client.dataconn import DataConnection
from metaq_broker.errors import ConfigError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.protocol import rawput, records
from metaq_broker.server import member
from metaq_broker.server.broker import Broker
from metaq_broker.server.config import load, topic_config_from, topic_ini_values
from metaq_broker.store import TopicConfig

pytestmark = pytest.mark.unit


def write(tmp_path, text):
    path = tmp_path / "broker.ini"
    path.write_text(text)
    return str(path)


# -- keys ---------------------------------------------------------------------------------------------
def test_defaults():
    cfg = load(None)
    assert (cfg.replica_id, cfg.replica_lag_max_ms, cfg.unclean_election) == (0, 10_000, False)
    assert (cfg.zk_session_timeout_ms, cfg.zk_max_session_timeout_ms) == (10_000, 40_000)
    assert cfg.topic_defaults.min_insync_replicas == 1


def test_keys_in_system_and_topic_sections_and_flags(tmp_path):
    path = write(tmp_path, """
[system]
brokerId=3
replicaId=2
replicaLagMaxMs=3000
uncleanElection=TRUE
minInSyncReplicas=2
zk.sessionTimeout=50000
zk.maxSessionTimeout=60000

[topic=orders]
minInSyncReplicas=3

[topic=logs]
numPartitions=2
""")
    cfg = load(path, {"uncleanElection": "false"})
    assert (cfg.broker_id, cfg.replica_id, cfg.replica_lag_max_ms, cfg.unclean_election) == (3, 2, 3000, False)
    assert (cfg.zk_session_timeout_ms, cfg.zk_max_session_timeout_ms) == (50_000, 60_000)
    assert cfg.topic_defaults.min_insync_replicas == 2
    assert cfg.topics["orders"].min_insync_replicas == 3
    assert cfg.topics["logs"].min_insync_replicas == 2  # inherited from [system]


@pytest.mark.parametrize("text,overrides,match", [
    ("[system]\nreplicaId=256\n", {}, r"\[system\] replicaId: 256 is outside 0..255"),
    ("[system]\nreplicaId=-1\n", {}, r"replicaId: -1 is outside"),
    ("[system]\nreplicaId=one\n", {}, r"replicaId: 'one' is not an integer"),
    ("[system]\nreplicaLagMaxMs=0\n", {}, r"replicaLagMaxMs: 0 is outside"),
    ("[system]\nuncleanElection=yes\n", {}, r"uncleanElection: 'yes' is not true or false"),
    ("[system]\nminInSyncReplicas=0\n", {}, r"\[system\] minInSyncReplicas: 0 is outside 1..256"),
    ("[topic=orders]\nminInSyncReplicas=0\n", {}, r"\[topic=orders\] minInSyncReplicas: 0 is outside"),
    ("[system]\nzk.maxSessionTimeout=10\n", {}, r"zk.maxSessionTimeout: 10 is outside"),
    # ZooKeeper would lower the session timeout silently, and the master's lease assumes it did not
    ("[system]\nzk.sessionTimeout=40001\n", {},
     r"zk.sessionTimeout: 40001 is above zk.maxSessionTimeout 40000: ZooKeeper silently lowers"),
    ("[system]\nzk.sessionTimeout=30000\n", {"zk.maxSessionTimeout": "20000"},
     r"zk.sessionTimeout: 30000 is above zk.maxSessionTimeout 20000"),
    # members copy the master's log through the data port
    ("[system]\nreplicaId=1\ndataPort=-1\n", {}, r"dataPort: -1 \(off\) with replicaId 1: .*data port"),
    ("[system]\ndataPort=-1\n", {"replicaId": "2"}, r"dataPort: -1 \(off\) with replicaId 2"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, text, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(write(tmp_path, text), overrides)


def test_what_stays_allowed():
    assert load(None, {"dataPort": "-1"}).data_port == -1  # replicaId 0 (the default): no group implied
    assert load(None, {"dataPort": "-1", "replicaId": "0"}).data_port == -1
    assert load(None, {"zk.sessionTimeout": "40000"}).zk_session_timeout_ms == 40_000  # equal is fine
    # without ZooKeeper there is no session to be lowered
    assert load(None, {"zk.connect": "none", "zk.sessionTimeout": "60000"}).zk_session_timeout_ms == 60_000


def test_min_insync_replicas_round_trips_through_topic_ini_values():
    config = topic_config_from(TopicConfig(), {"minInSyncReplicas": "2", "numPartitions": "3"}, "topic 'x'")
    values = topic_ini_values(config)
    assert values["minInSyncReplicas"] == "2"
    assert topic_config_from(TopicConfig(), values, "again") == config
    # a runtime-topics file written before the key: the default
    old = {k: v for k, v in values.items() if k != "minInSyncReplicas"}
    assert topic_config_from(TopicConfig(), old, "old").min_insync_replicas == 1
    with pytest.raises(ConfigError, match="min_insync_replicas must be between 1 and 256"):
        TopicConfig(min_insync_replicas=0)


def start_broker(tmp_path, **settings):
    overrides = {"brokerId": 1, "replicaId": 2, "serverPort": 0, "kafkaPort": 0, "zk.connect": "none",
                 "dataPath": tmp_path / "data", **settings}
    return Broker(load(None, {k: str(v) for k, v in overrides.items()})).start()


def test_runtime_topic_keeps_min_insync_replicas_across_a_restart(tmp_path):
    b = start_broker(tmp_path, minInSyncReplicas=2)
    try:
        b.create_topic("orders", 2, {"minInSyncReplicas": "3"})
        b.create_topic("logs", 1, {})
        with closing(BrokerConnection(b.address, timeout=10)) as conn:
            assert conn.call("DescribeTopic", pb.TopicRequest(topic="orders")).config["minInSyncReplicas"] == "3"
    finally:
        b.stop(grace=1)
    b = start_broker(tmp_path, minInSyncReplicas=2)
    try:
        assert b.store.topic_config("orders").min_insync_replicas == 3
        assert b.store.topic_config("logs").min_insync_replicas == 2  # the [system] default it was made with
        with closing(BrokerConnection(b.address, timeout=10)) as conn:
            assert conn.call("DescribeTopic", pb.TopicRequest(topic="orders")).config["minInSyncReplicas"] == "3"
    finally:
        b.stop(grace=1)


# -- PutRaw's acks flag -------------------------------------------------------------------------------
def test_putraw_acks_flag_round_trip():
    body = records.encode_body([b"a", b"bc"])
    args = ("t", 0, "", body.count, body.attributes, body.crc, body.parts)
    default = rawput.pack(*args)
    assert int.from_bytes(default[4:8], "little") == 0  # what every older client sent: acks=all
    assert rawput.unpack(default).acks == rawput.ACKS_ALL
    assert rawput.pack(*args, acks="all") == default and rawput.pack(*args, acks=-1) == default
    one = rawput.pack(*args, acks="1")
    assert int.from_bytes(one[4:8], "little") == rawput.FLAG_ACKS_ONE
    r = rawput.unpack(one)
    assert r.acks == rawput.ACKS_ONE == pb.PutRequest(acks=1).acks
    assert (r.topic, r.partition, r.xid, bytes(r.batch.body)) == ("t", 0, "", b"".join(bytes(p) for p in body.parts))
    assert b"".join(rawput.pack_parts(*args, acks=1)) == one
    # unknown flag bits are ignored, as they were before acks (bit 1, FLAG_PRODUCER, announces a producer block)
    unknown = 0xFFFF & ~(rawput.FLAG_ACKS_ONE | rawput.FLAG_PRODUCER)
    assert rawput.unpack(default[:4] + unknown.to_bytes(4, "little") + default[8:]).acks == rawput.ACKS_ALL
    assert rawput.unpack(default[:4] + (unknown | 1).to_bytes(4, "little") + default[8:]).acks == rawput.ACKS_ONE
    for bad in ("0", 0, 2, "one", True, None):
        with pytest.raises(ValueError, match="acks"):
            rawput.pack(*args, acks=bad)


def test_put_request_acks_defaults_to_all_and_offsets_carry_high_watermark():
    assert pb.PutRequest.FromString(pb.PutRequest(topic="t").SerializeToString()).acks == 0
    assert pb.PartitionOffsets(high_watermark=7).high_watermark == 7
    reply = pb.DescribeGroupResponse(broker_id=1, epoch=7, master=0, unclean=False, members=[
        pb.GroupMemberInfo(replica_id=1, uuid="ab" * 16, address="h:1", data_address="h:2", role="replica",
                           in_sync=True, lag_offsets=12, last_caught_up_ms_ago=5, journal_lag=0)])
    assert pb.DescribeGroupResponse.FromString(reply.SerializeToString()) == reply


def test_a_broker_takes_acks_one_puts_on_both_paths(tmp_path):
    """Until replication acts on it, the flag changes nothing: both spellings are stored and answered."""
    b = start_broker(tmp_path, dataPort=0)
    try:
        b.create_topic("t", 1, {})
        body = records.encode_body([b"x"])
        with closing(BrokerConnection(b.address, timeout=10)) as conn, DataConnection(f"127.0.0.1:{b.data_port}") as d:
            for i, acks in enumerate(["all", "1"]):
                r = conn.call("PutRaw", rawput.pack("t", 0, "", body.count, body.attributes, body.crc, body.parts,
                                                    acks=acks))
                assert (r.base_offset, r.count) == (2 * i, 1)
                d.send_put(rawput.pack_parts("t", 0, "", body.count, body.attributes, body.crc, body.parts,
                                             acks=acks))
                assert d.receive_put()[0] == 2 * i + 1
            assert conn.call("Put", pb.PutRequest(topic="t", partition=0, acks=1, batch=pb.MessageBatch(
                count=body.count, attributes=body.attributes, body=b"".join(bytes(p) for p in body.parts),
                body_crc=body.crc))).base_offset == 4
    finally:
        b.stop(grace=1)


# -- member.json --------------------------------------------------------------------------------------
def test_member_json_created_once_then_reloaded(tmp_path):
    data = tmp_path / "data"
    first = member.load_or_create(data, 1, 2)
    assert first.created_now and re.fullmatch(r"[0-9a-f]{32}", first.uuid) and len(first.uuid_bytes) == 16
    path = data / "replication" / "member.json"
    stored = json.loads(path.read_text())
    assert stored == {"brokerId": 1, "replicaId": 2, "uuid": first.uuid, "created": first.created}
    again = member.load_or_create(str(data), 1, 2)
    assert not again.created_now
    assert (again.broker_id, again.replica_id, again.uuid, again.created) == (1, 2, first.uuid, first.created)
    assert path.read_text() == json.dumps(stored) + "\n"  # not rewritten
    # a wiped data directory is a new incarnation
    path.unlink()
    fresh = member.load_or_create(data, 1, 2)
    assert fresh.created_now and fresh.uuid != first.uuid


@pytest.mark.parametrize("broker_id,replica_id", [(1, 3), (4, 2), (4, 3)])
def test_member_json_of_another_member_is_refused(tmp_path, broker_id, replica_id):
    member.load_or_create(tmp_path, 1, 2)
    before = (tmp_path / "replication" / "member.json").read_bytes()
    with pytest.raises(ConfigError) as e:
        member.load_or_create(tmp_path, broker_id, replica_id)
    text = str(e.value)
    assert str(tmp_path / "replication" / "member.json") in text
    assert "brokerId 1 replicaId 2" in text and f"brokerId {broker_id} replicaId {replica_id}" in text
    assert "another dataPath" in text and "delete" in text
    assert (tmp_path / "replication" / "member.json").read_bytes() == before


@pytest.mark.parametrize("content,match", [
    (b"{not json", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"brokerId": 1, "replicaId": 2, "uuid": "xyz", "created": 1.0}', "uuid 'xyz'"),
    (b'{"brokerId": "1", "replicaId": 2, "uuid": "' + b"a" * 32 + b'", "created": 1.0}', "brokerId '1'"),
    (b'{"brokerId": 1, "replicaId": 2, "uuid": "' + b"a" * 32 + b'"}', "created None"),
])
def test_a_damaged_member_json_is_refused(tmp_path, content, match):
    (tmp_path / "replication").mkdir()
    (tmp_path / "replication" / "member.json").write_bytes(content)
    with pytest.raises(ConfigError, match=f"member.json is damaged.*{match}"):
        member.load_or_create(tmp_path, 1, 2)
