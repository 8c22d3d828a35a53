"""A broker's topic entries (``<root>/brokers/metaq/topics/<topic>/<brokerId>-m``, JSON ``{"numPartitions",
"brokerId"}``, and ``"static": true`` for a topic of the broker's server.ini, which no deletion may remove:
it would come back at the broker's restart): persistent, so a broker that is down keeps its partitions in the
cluster's view (keys do not move, queries keep their offsets). The broker writes them when it registers; these are
the reads and removals the broker (stale entries at registration) and ``metaq brokers forget`` share. (MetaQ's own
entries in ``topics-pub|sub`` are ephemeral, written only by a broker with a MetaQ listener:
``zk/metaq_nodes.py``.)"""
from __future__ import annotations

import json

from kazoo.exceptions import NoNodeError

from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children


def entry(num_partitions: int, broker_id: int, static: bool = False) -> bytes:
    """The JSON of an entry."""
    return json.dumps({"numPartitions": int(num_partitions), "brokerId": int(broker_id),
                       **({"static": True} if static else {})}).encode()


def parse_entry(data: bytes) -> tuple:
    """(brokerId, numPartitions) of an entry's JSON; ValueError, KeyError or TypeError when it is none."""
    m = json.loads(data)
    return int(m["brokerId"]), int(m["numPartitions"])


def topics_of(zk, paths: ZkPaths, broker_id: int) -> list:
    """The topics with an entry of ``broker_id``, sorted."""
    return sorted(t for t in children(zk, paths.topics()) if zk.exists(paths.topic_entry(t, broker_id)))


def _entries_data(zk, paths: ZkPaths, topic: str):
    """The data of each of ``topic``'s entries that is there when read (none for a topic no broker has)."""
    for name in children(zk, paths.topic(topic)):
        try:
            yield zk.get(f"{paths.topic(topic)}/{name}")[0]
        except NoNodeError:
            continue


def partition_counts(zk, paths: ZkPaths, topic: str) -> dict:
    """``{brokerId: numPartitions}`` of ``topic`` from its entries (brokers down at the moment included);
    {} for a topic no broker has. An unreadable entry counts as none."""
    counts = {}
    for data in _entries_data(zk, paths, topic):
        try:
            broker_id, n = parse_entry(data)
            counts[broker_id] = n
        except (ValueError, KeyError, TypeError):
            continue
    return counts


def static_brokers(zk, paths: ZkPaths, topic: str) -> list:
    """The brokers whose server.ini configures ``topic`` (their entries say ``static``), sorted."""
    found = []
    for data in _entries_data(zk, paths, topic):
        try:
            m = json.loads(data)
            if m.get("static") is True:
                found.append(int(m["brokerId"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(found)


def delete(zk, paths: ZkPaths, topic: str, broker_id: int) -> None:
    """Remove ``broker_id``'s entry of ``topic``; a missing one is fine."""
    try:
        zk.delete(paths.topic_entry(topic, broker_id))
    except NoNodeError:
        pass
