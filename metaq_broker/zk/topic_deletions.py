"""Topic deletions in ZooKeeper, as Kafka records them: ``<root>/admin/delete_topics/<topic>``, written by the
broker that takes the request (Kafka's DeleteTopics), read by every broker (``server/topic_deletion.py``).

A record stays until no broker has an entry of the topic (``brokers/metaq/topics/<topic>/<b>-m``) any more;
then ``finish`` removes what the cluster kept of the topic: Kafka's partition map (a topic created again gets a
new topic id and numbers from 0), every group's offsets of it (metaq's ``consumers/<g>/metaq/offsets/<topic>``
and MetaQ's ``consumers/<g>/offsets/<topic>``), the topic's node, and the record last. Each step is
idempotent, so any broker may finish (or finish again) what a crash cut short.
"""
from __future__ import annotations

import json
import time
from kazoo.exceptions import NodeExistsError, NoNodeError, NotEmptyError

from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children


def record(zk, paths: ZkPaths, topic: str, requested_by: str, broker_id: int, acl=None) -> bool:
    """Record ``topic``'s deletion; False if it was recorded already."""
    data = json.dumps({"version": 1, "requestedBy": requested_by, "broker": broker_id,
                       "time": int(time.time() * 1000)}).encode()
    try:
        zk.create(paths.topic_deletion(topic), data, acl=acl, makepath=True)
        return True
    except NodeExistsError:
        return False


def pending(zk, paths: ZkPaths, watch=None) -> list:
    """The topics whose deletion is recorded, sorted (``watch``: called once when that changes)."""
    try:
        return sorted(zk.get_children(paths.topic_deletions(), watch=watch))
    except NoNodeError:
        if watch is not None and zk.exists(paths.topic_deletions(), watch=watch):
            return pending(zk, paths, watch)  # made meanwhile
        return []


def finish(zk, paths: ZkPaths, topic: str) -> bool:
    """If no broker has an entry of ``topic``: remove its partition map, its groups' offsets, its node and
    then the record; True once done. False while some broker still has the topic."""
    if children(zk, paths.topic(topic)):
        return False
    _delete(zk, paths.kafka_topic(topic))
    layout = MetaqZkLayout(paths.root)
    for group in children(zk, paths.consumers()):
        try:
            _delete(zk, paths.group_offsets(group, topic), recursive=True)
            _delete(zk, layout.group_offsets(group, topic), recursive=True)
        except ValueError:  # a node no metaq client made (a name that cannot be a group): not ours to touch
            continue
    try:
        zk.delete(paths.topic(topic))
    except NoNodeError:
        pass
    except NotEmptyError:
        return False  # a broker registered the topic just now: it is not gone
    _delete(zk, paths.topic_deletion(topic))
    return True


def _delete(zk, path: str, recursive: bool = False) -> None:
    try:
        zk.delete(path, recursive=recursive)
    except NoNodeError:
        pass
