"""MetaQ 1.4's own ZooKeeper layout: the paths and data MetaQ clients read, built and parsed in one place.

Pure: no ZooKeeper session. MetaQ clients read, under the same root as metaq (``zk.root``, ``/meta``)::

    <root>/brokers/ids/<brokerId>                   persistent parent; a master also writes its URI here
                                                    (clients before 1.4)
    <root>/brokers/ids/<brokerId>/master            ephemeral, meta://<host>:<port>
    <root>/brokers/ids/<brokerId>/slave<slaveId>    ephemeral, a slave's URI
    <root>/brokers/ids/<brokerId>/master_config_checksum   the master's config checksum
    <root>/brokers/topics/<topic>/<brokerId>-m      the partition count in ASCII (layout before 1.4.3)
    <root>/brokers/topics-pub/<topic>/<brokerId>-m  {"numParts":n,"broker":"<brokerId>-m"} (slaves: -s<id>)
    <root>/brokers/topics-sub/<topic>/<brokerId>-m  the same
    <root>/consumers/<group>/offsets/<topic>/<b>-<n>   <msgId>-<offset> (before 1.4: <offset>)

metaq's own nodes are elsewhere (``zk/paths.py``); a broker with a MetaQ listener writes these too
(``zk/metaq_nodes.py``), and brokers keep the group offsets of both in step (``server/offset_bridge.py``).
Before issue 28 metaq's own data sat at some of these paths (``zk/layout_upgrade.py`` moves it).
"""
from __future__ import annotations

import json
import re

from metaq_broker.names import parse_partition_name, whole_number
from metaq_broker.zk.paths import check_component, normalize_root

SCHEME = "meta"
_URI = re.compile(r"meta://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})")
_BROKER_ENTRY = re.compile(r"(0|[1-9][0-9]*)-(m|s(0|[1-9][0-9]*))")


class MetaqZkLayout:
    """MetaQ's znode paths under one root."""

    def __init__(self, root: str = "/meta"):
        self.root = normalize_root(root)

    def __repr__(self) -> str:
        return f"MetaqZkLayout({self.root or '/'!r})"

    def broker_ids(self) -> str:
        return f"{self.root}/brokers/ids"

    def broker(self, broker_id: int) -> str:
        return f"{self.broker_ids()}/{whole_number('broker id', broker_id)}"

    def broker_master(self, broker_id: int) -> str:
        return f"{self.broker(broker_id)}/master"

    def broker_slave(self, broker_id: int, slave_id: int) -> str:
        return f"{self.broker(broker_id)}/slave{whole_number('slave id', slave_id)}"

    def master_config_checksum(self, broker_id: int) -> str:
        return f"{self.broker(broker_id)}/master_config_checksum"

    def topics_legacy(self) -> str:
        return f"{self.root}/brokers/topics"

    def topic_legacy(self, topic: str) -> str:
        return f"{self.topics_legacy()}/{check_component('topic', topic)}"

    def topic_legacy_broker(self, topic: str, broker_id: int) -> str:
        return f"{self.topic_legacy(topic)}/{broker_entry(broker_id)}"

    def topics_pub(self) -> str:
        return f"{self.root}/brokers/topics-pub"

    def topic_pub(self, topic: str) -> str:
        return f"{self.topics_pub()}/{check_component('topic', topic)}"

    def topic_pub_broker(self, topic: str, broker_id: int, slave_id: int | None = None) -> str:
        return f"{self.topic_pub(topic)}/{broker_entry(broker_id, slave_id)}"

    def topics_sub(self) -> str:
        return f"{self.root}/brokers/topics-sub"

    def topic_sub(self, topic: str) -> str:
        return f"{self.topics_sub()}/{check_component('topic', topic)}"

    def topic_sub_broker(self, topic: str, broker_id: int, slave_id: int | None = None) -> str:
        return f"{self.topic_sub(topic)}/{broker_entry(broker_id, slave_id)}"

    def consumers(self) -> str:
        return f"{self.root}/consumers"

    def group_offset_topics(self, group: str) -> str:
        return f"{self.consumers()}/{check_component('group', group)}/offsets"

    def group_offsets(self, group: str, topic: str) -> str:
        return f"{self.group_offset_topics(group)}/{check_component('topic', topic)}"

    def group_offset(self, group: str, topic: str, partition_name: str) -> str:
        parse_partition_name(partition_name)
        return f"{self.group_offsets(group, topic)}/{partition_name}"


def broker_entry(broker_id: int, slave_id: int | None = None) -> str:
    """``3-m`` for broker 3's master, ``3-s1`` for its slave 1: MetaQ's names of a topic's brokers."""
    b = whole_number("broker id", broker_id)
    return f"{b}-m" if slave_id is None else f"{b}-s{whole_number('slave id', slave_id)}"


def parse_broker_entry(name: str) -> tuple:
    """``"3-m"`` → ``(3, None)``, ``"3-s1"`` → ``(3, 1)``."""
    m = _BROKER_ENTRY.fullmatch(name) if isinstance(name, str) else None
    if not m:
        raise ValueError(f"broker entry {name!r} is not of the form <brokerId>-m or <brokerId>-s<slaveId>")
    return int(m.group(1)), None if m.group(3) is None else int(m.group(3))


def broker_uri(host: str, port: int) -> str:
    """``meta://host:port`` (an IPv6 address in brackets)."""
    if not isinstance(host, str) or not host or any(c in host for c in " /[]") or host.count(":") == 1:
        raise ValueError(f"host {host!r} cannot be written in a meta:// URI")
    port = whole_number("port", port, 65536)
    return f"{SCHEME}://[{host}]:{port}" if ":" in host else f"{SCHEME}://{host}:{port}"


def parse_broker_uri(uri: str) -> tuple:
    """``"meta://10.0.0.1:8123"`` → ``("10.0.0.1", 8123)``; ValueError naming the URI otherwise."""
    m = _URI.fullmatch(uri.strip()) if isinstance(uri, str) else None
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"broker URI {uri!r} is not meta://<host>:<port>")
    host = m.group(1)
    return (host[1:-1] if host.startswith("[") else host), int(m.group(2))


def topic_entry(num_parts: int, broker_id: int, slave_id: int | None = None) -> bytes:
    """The JSON of a ``topics-pub``/``topics-sub`` entry, exactly the two fields MetaQ writes."""
    n = whole_number("partition count", num_parts)
    return json.dumps({"numParts": n, "broker": broker_entry(broker_id, slave_id)}, separators=(",", ":")).encode()


def parse_topic_entry(data: bytes) -> tuple:
    """(numParts, brokerId, slaveId or None) of a ``topics-pub``/``topics-sub`` entry."""
    try:
        doc = json.loads(data)
        n = whole_number("numParts", doc["numParts"])
        broker = parse_broker_entry(doc["broker"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"topic entry {data[:80]!r} is not MetaQ's {{\"numParts\":n,\"broker\":\"<id>-m\"}}: {e}") from None
    return n, broker[0], broker[1]


def format_group_offset(msg_id: int, offset: int) -> bytes:
    """``<msgId>-<offset>``: a MetaQ consumer group's committed position (msgId -1: none known)."""
    if isinstance(msg_id, bool) or not isinstance(msg_id, int) or not -(1 << 63) <= msg_id < (1 << 63):
        raise ValueError(f"message id must be a 64-bit integer, got {msg_id!r}")
    return f"{msg_id}-{whole_number('offset', offset, 1 << 63)}".encode()


def parse_group_offset(data: bytes) -> tuple:
    """(msgId, offset) of ``<msgId>-<offset>``, or (-1, offset) of a plain offset (clients before 1.4)."""
    text = data.decode("ascii", "replace").strip() if isinstance(data, (bytes, bytearray)) else str(data)
    head, sep, tail = text.rpartition("-")
    try:
        if not re.fullmatch(r"[0-9]{1,19}", tail) or (sep and not re.fullmatch(r"-?[0-9]{1,19}", head)):
            raise ValueError
        return (int(head) if sep else -1), whole_number("offset", int(tail), 1 << 63)
    except ValueError:
        raise ValueError(f"group offset {text[:80]!r} is not <msgId>-<offset> or <offset>") from None
