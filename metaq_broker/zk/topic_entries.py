"""A broker's topic entries (``<root>/brokers/topics-pub|topics-sub/<topic>/<brokerId>-m``): persistent,
so a broker that is down keeps its partitions in the cluster's view (keys do not move, queries keep
their offsets). The broker writes them when it registers; these are the reads and removals the broker
(stale entries at registration) and ``metaq brokers forget`` share."""
from __future__ import annotations

from kazoo.exceptions import NoNodeError

from metaq_broker.zk.paths import ZkPaths


def topics_of(zk, paths: ZkPaths, broker_id: int) -> list:
    """The topics with an entry of ``broker_id`` (in topics-pub), sorted."""
    try:
        topics = zk.get_children(paths.topics_pub())
    except NoNodeError:
        return []
    return sorted(t for t in topics if zk.exists(paths.topic_pub_broker(t, broker_id)))


def delete(zk, paths: ZkPaths, topic: str, broker_id: int) -> None:
    """Remove ``broker_id``'s entries of ``topic`` (both trees); missing ones are fine."""
    for path in (paths.topic_pub_broker(topic, broker_id), paths.topic_sub_broker(topic, broker_id)):
        try:
            zk.delete(path)
        except NoNodeError:
            pass
