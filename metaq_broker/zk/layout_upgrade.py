"""A broker's part in leaving the ZooKeeper layout before issue 28, where metaq kept its own data at the
paths MetaQ clients read (docs/protocol.md, "ZooKeeper layout", Upgrading):

* topic entries ``brokers/topics-pub|sub/<topic>/<b>-m`` with metaq's JSON (``{"numPartitions",
  "brokerId"}``, persistent) are copied to ``brokers/metaq/topics/<topic>/<b>-m`` where none is, then
  removed: this broker's own, and those of brokers not registered in that older layout now (down, or
  upgraded); a broker of the older layout that is up keeps its entries (and writes them again when it
  registers), so clients of either version find its partitions until it is upgraded.
* the master node ``brokers/ids/<b>`` (ephemeral) needs no copy: a newer member follows an older master
  holding it and never stands against it (``zk/groups.py``), and its crashed run's node is taken over
  like any other (``groups.take_over_stale``).
* group offsets (bare decimals at ``consumers/<group>/offsets/...``) of this broker's partitions are copied
  to metaq's nodes where those are older (``GroupStore.adopt_legacy``); the original stays until the
  partition's master puts MetaQ's ``<msgId>-<byteOffset>`` there (``server/offset_bridge.py``).

Nothing is removed that was not copied first (or is a copy already); sink decision records, users, ACLs,
Kafka's maps and group states have not moved. Every step is idempotent: a broker that dies halfway
repeats it at its next start."""
from __future__ import annotations

import logging

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from metaq_broker.zk import topic_entries
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import children

log = logging.getLogger(__name__)


def legacy_topic_entry(data) -> tuple:
    """(brokerId, numPartitions) of a topic entry in metaq's JSON; None for anything else (MetaQ's)."""
    try:
        return topic_entries.parse_entry(data)
    except (ValueError, KeyError, TypeError):
        return None


def upgrade(zk, paths: ZkPaths, broker_id: int, acl=None) -> dict:
    """Move what the layout before issue 28 left (above); returns how much moved, by kind (empty: nothing)."""
    layout = MetaqZkLayout(paths.root)
    counts = {"topic entries copied": 0, "old topic entries removed": 0, "group offsets copied": 0}
    for tree in (layout.topics_pub(), layout.topics_sub()):
        for topic in children(zk, tree):
            for name in children(zk, f"{tree}/{topic}"):
                copied, removed = _move_entry(zk, paths, layout, f"{tree}/{topic}/{name}", topic, broker_id, acl)
                counts["topic entries copied"] += copied
                counts["old topic entries removed"] += removed
    counts["group offsets copied"] = GroupStore(zk, paths.root).adopt_legacy(broker_id)
    return {k: v for k, v in counts.items() if v}


def forget(zk, paths: ZkPaths, broker_id: int) -> list:
    """``metaq brokers --forget``: the topics of ``broker_id``'s entries of the older layout (metaq's JSON in
    ``topics-pub|sub``), which are removed."""
    layout, topics = MetaqZkLayout(paths.root), set()
    for tree in (layout.topics_pub(), layout.topics_sub()):
        for topic in children(zk, tree):
            path = f"{tree}/{topic}/{int(broker_id)}-m"
            try:
                data, stat = zk.get(path)
                if not stat.ephemeralOwner and (legacy_topic_entry(data) or (None,))[0] == broker_id:
                    zk.delete(path, version=stat.version)
                    topics.add(topic)
            except (NoNodeError, BadVersionError):
                continue
    return sorted(topics)


def _move_entry(zk, paths: ZkPaths, layout: MetaqZkLayout, path: str, topic: str, broker_id: int, acl) -> tuple:
    try:
        data, stat = zk.get(path)
    except NoNodeError:
        return 0, 0
    entry = legacy_topic_entry(data)
    if entry is None or stat.ephemeralOwner or path.rsplit("/", 1)[1] != f"{entry[0]}-m":
        return 0, 0  # MetaQ's (ephemeral, of a broker with a MetaQ listener), or not an entry of ours
    owner, n = entry
    copied = 0
    try:
        zk.create(paths.topic_entry(topic, owner), topic_entries.entry(n, owner), acl=acl, makepath=True)
        copied = 1
    except NodeExistsError:
        pass  # copied before, or written by the upgraded broker itself: that one is newer
    except ValueError:
        return 0, 0  # a topic name that cannot be one of ours
    if owner != broker_id and _registered_before_upgrade(zk, layout, owner):
        return copied, 0  # a broker of the older layout is up: its clients and its registrations use it
    try:
        zk.delete(path, version=stat.version)
    except (NoNodeError, BadVersionError):
        return copied, 0
    return copied, 1


def _registered_before_upgrade(zk, layout: MetaqZkLayout, broker_id: int) -> bool:
    """A broker of the layout before issue 28 is master of group ``broker_id`` now (its ephemeral node)."""
    stat = zk.exists(layout.broker(broker_id))
    return stat is not None and stat.ephemeralOwner != 0


