"""A broker's topic entries (``<root>/brokers/topics-pub|topics-sub/<topic>/<brokerId>-m``): persistent,
so a broker that is down keeps its partitions in the cluster's view (keys do not move, queries keep
their offsets). The broker writes them when it registers; these are the reads and removals the broker
(stale entries at registration) and ``metaq brokers forget`` share."""
from __future__ import annotations

import json

from kazoo.exceptions import NoNodeError

from metaq_broker.zk.paths import ZkPaths


def topics_of(zk, paths: ZkPaths, broker_id: int) -> list:
    """The topics with an entry of ``broker_id`` (in topics-pub), sorted."""
    try:
        topics = zk.get_children(paths.topics_pub())
    except NoNodeError:
        return []
    return sorted(t for t in topics if zk.exists(paths.topic_pub_broker(t, broker_id)))


def partition_counts(zk, paths: ZkPaths, topic: str) -> dict:
    """``{brokerId: numPartitions}`` of ``topic`` from its entries (brokers down at the moment included);
    {} for a topic no broker has. An unreadable entry counts as none."""
    try:
        entries = zk.get_children(paths.topic_pub(topic))
    except NoNodeError:
        return {}
    counts = {}
    for entry in entries:
        try:
            data, _ = zk.get(f"{paths.topic_pub(topic)}/{entry}")
            m = json.loads(data)
            counts[int(m["brokerId"])] = int(m["numPartitions"])
        except (NoNodeError, ValueError, KeyError, TypeError):
            continue
    return counts


def delete(zk, paths: ZkPaths, topic: str, broker_id: int) -> None:
    """Remove ``broker_id``'s entries of ``topic`` (both trees); missing ones are fine."""
    for path in (paths.topic_pub_broker(topic, broker_id), paths.topic_sub_broker(topic, broker_id)):
        try:
            zk.delete(path)
        except NoNodeError:
            pass
