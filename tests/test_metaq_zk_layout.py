"""MetaQ's ZooKeeper layout (zk/metaq_layout.py): the paths and data MetaQ 1.4 clients read
(shared/reference/metaq-1.4-clients.md), spelled exactly, and bad names or data refused with the
problem named."""
import pytest

from metaq_broker.zk.metaq_layout import (MetaqZkLayout, broker_entry, broker_uri, format_group_offset,
                                          parse_broker_entry, parse_broker_uri, parse_group_offset,
                                          parse_topic_entry, topic_entry)

pytestmark = pytest.mark.unit


def test_paths_as_metaq_clients_read_them():
    z = MetaqZkLayout("/meta")
    assert z.broker(3) == "/meta/brokers/ids/3"
    assert z.broker_master(3) == "/meta/brokers/ids/3/master"
    assert z.broker_slave(3, 1) == "/meta/brokers/ids/3/slave1"
    assert z.master_config_checksum(3) == "/meta/brokers/ids/3/master_config_checksum"
    assert z.topic_legacy_broker("orders", 3) == "/meta/brokers/topics/orders/3-m"
    assert z.topic_pub_broker("orders", 3) == "/meta/brokers/topics-pub/orders/3-m"
    assert z.topic_sub_broker("orders", 3, 0) == "/meta/brokers/topics-sub/orders/3-s0"
    assert z.group_offset("g", "orders", "3-1") == "/meta/consumers/g/offsets/orders/3-1"
    assert MetaqZkLayout("").broker_ids() == "/brokers/ids"


@pytest.mark.parametrize("call, problem", [
    (lambda z: z.broker(-1), "broker id must be non-negative"),
    (lambda z: z.topic_pub("a/b"), "contains '/'"),
    (lambda z: z.group_offset("g", "t", "3-01"), "not of the form <brokerId>-<n>"),
    (lambda z: z.broker_slave(1, "x"), "slave id must be an integer"),
])
def test_bad_names_are_refused(call, problem):
    with pytest.raises(ValueError, match=problem):
        call(MetaqZkLayout())


def test_broker_uri():
    assert broker_uri("10.0.0.1", 8123) == "meta://10.0.0.1:8123"
    assert broker_uri("::1", 8123) == "meta://[::1]:8123"
    assert parse_broker_uri("meta://[::1]:8123") == ("::1", 8123)
    assert parse_broker_uri("meta://host.example:1\n") == ("host.example", 1)
    for bad in ("http://h:1", "meta://h", "meta://h:0", "meta://h:70000", "meta://h:1/x", "meta://a b:1"):
        with pytest.raises(ValueError, match="is not meta://<host>:<port>"):
            parse_broker_uri(bad)
    for host in ("", "a b", "h/x", "h:1"):
        with pytest.raises(ValueError, match="cannot be written"):
            broker_uri(host, 1)


def test_topic_entries_hold_exactly_metaq_fields():
    assert topic_entry(4, 3) == b'{"numParts":4,"broker":"3-m"}'
    assert topic_entry(1, 0, 2) == b'{"numParts":1,"broker":"0-s2"}'
    assert parse_topic_entry(b'{"numParts":4,"broker":"3-m"}') == (4, 3, None)
    assert parse_broker_entry("12-s3") == (12, 3) and broker_entry(12) == "12-m"
    for bad in (b'{"numPartitions":4,"brokerId":3}', b"4", b'{"numParts":-1,"broker":"3-m"}',
                b'{"numParts":1,"broker":"3-x"}', b"not json"):
        with pytest.raises(ValueError, match="topic entry"):
            parse_topic_entry(bad)


def test_group_offsets_in_both_forms():
    assert format_group_offset(123456789, 4096) == b"123456789-4096"
    assert format_group_offset(-1, 0) == b"-1-0"
    assert parse_group_offset(b"123456789-4096") == (123456789, 4096)
    assert parse_group_offset(b"-1-4096") == (-1, 4096)
    assert parse_group_offset(b"4096") == (-1, 4096)  # written by clients before 1.4
    for bad in (b"", b"x-1", b"1-", b"1--2", b"-5", b"1-2-3", b"1- 2"):
        with pytest.raises(ValueError, match="is not <msgId>-<offset>"):
            parse_group_offset(bad)
    with pytest.raises(ValueError):
        format_group_offset(1, -1)
