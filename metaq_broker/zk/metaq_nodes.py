"""The nodes MetaQ 1.4 clients find a broker by, as a broker with a MetaQ listener writes them
(``zk/metaq_layout.py`` spells them; docs/protocol.md, "ZooKeeper layout"):

* ``brokers/ids/<b>``: persistent. Every elected master makes sure it exists (``zk/groups.py``), so a
  broker of the layout before issue 28, which registered its master node there as an ephemeral node, can
  never be elected beside a newer one. Its data is the master's ``meta://`` URI while a master with a
  MetaQ listener serves (clients before 1.4 read it), else empty.
* ``brokers/ids/<b>/master`` and ``slave<replicaId>``: ephemeral, the MetaQ listener's ``meta://`` URI of
  the group's master and of its other members.
* ``brokers/topics/<topic>/<b>-m`` (the partition count in ASCII, clients before 1.4.3) and
  ``brokers/topics-pub|sub/<topic>/<b>-m`` (``{"numParts":n,"broker":"<b>-m"}``): ephemeral, as MetaQ
  brokers write them, so a broker that is down drops out of MetaQ clients' views by itself.

The master's nodes follow metaq's own master node (``ZkPaths.broker``, created with the epoch in the
election's multi-op): they are written in one multi-op guarded by the group state's version, and only
while this session holds metaq's master node, so a member that lost an election (or its session) can
never overwrite what the newer master wrote. A node of an older session of this group (a crashed run's,
not yet expired) is replaced in the same multi-op."""
from __future__ import annotations

import logging
from typing import Optional

from kazoo.exceptions import (BadVersionError, KazooException, NodeExistsError, NoNodeError, NotEmptyError,
                              RolledBackError, RuntimeInconsistency)

from metaq_broker.zk import groups
from metaq_broker.zk.metaq_layout import MetaqZkLayout, topic_entry
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

ATTEMPTS = 5


def topic_nodes(layout: MetaqZkLayout, broker_id: int, topic: str, num_partitions: int) -> dict:
    """{path: data} of a master's three entries of one topic."""
    entry = topic_entry(num_partitions, broker_id)
    return {layout.topic_legacy_broker(topic, broker_id): str(int(num_partitions)).encode(),
            layout.topic_pub_broker(topic, broker_id): entry, layout.topic_sub_broker(topic, broker_id): entry}


def ensure_broker(zk, layout: MetaqZkLayout, broker_id: int, acl=None) -> None:
    """``brokers/ids/<b>`` exists (persistent: MetaQ's parent of ``master`` and ``slave<n>``)."""
    zk.ensure_path(layout.broker(broker_id), acl)


def publish_master(zk, paths: ZkPaths, layout: MetaqZkLayout, broker_id: int, replica_id: int,
                   uri: Optional[str], topics: dict, acl=None) -> bool:
    """As master of group ``broker_id``: ``brokers/ids/<b>`` holds ``uri``, ``master`` is ``uri`` and every
    topic of ``topics`` ({topic: numPartitions}) has its entries, all written in one multi-op that holds
    only while the group state names this member master and this session holds metaq's master node.
    ``uri`` None (a master without a MetaQ listener): ``brokers/ids/<b>`` is emptied of an earlier master's
    URI, nothing else is written. False (nothing written) when this member is not master."""
    ensure_broker(zk, layout, broker_id, acl)
    if uri is None and zk.get(layout.broker(broker_id))[0] == b"":
        return True  # nothing to do, without the reads below (a broker without a listener, every registration)
    wanted = {} if uri is None else {layout.broker_master(broker_id): uri.encode()}
    for topic, n in (topics.items() if uri is not None else ()):
        wanted.update(topic_nodes(layout, broker_id, topic, n))
    for path in {p.rsplit("/", 1)[0] for p in wanted}:
        zk.ensure_path(path, acl)
    for _ in range(ATTEMPTS):
        state = groups.read_state(zk, paths, broker_id)
        master = zk.exists(paths.broker(broker_id))
        if state is None or state.master != replica_id or master is None \
                or master.ephemeralOwner != zk.client_id[0]:
            return False
        t = zk.transaction()
        t.check(paths.group_state(broker_id), state.version)
        t.check(paths.broker(broker_id), master.version)
        parent_data, parent = zk.get(layout.broker(broker_id))
        if parent_data != (uri or "").encode():
            t.set_data(layout.broker(broker_id), (uri or "").encode(), parent.version)
        for path, data in wanted.items():
            _put_ephemeral(zk, t, path, data, acl)
        if _committed(t):
            return True
    return False


def withdraw_master(zk, layout: MetaqZkLayout, broker_id: int, uri: Optional[str], topics) -> None:
    """A master stepping down (or stopping): its ``master`` and topic entries go (those of this session only)
    and ``brokers/ids/<b>`` no longer names ``uri``."""
    paths = [layout.broker_master(broker_id)]
    for topic in topics:
        paths += list(topic_nodes(layout, broker_id, topic, 1))
    for path in paths:
        groups.delete_own(zk, path)
    if uri is not None:
        try:
            data, stat = zk.get(layout.broker(broker_id))
            if data == uri.encode():
                zk.set(layout.broker(broker_id), b"", version=stat.version)
        except (NoNodeError, BadVersionError):
            pass


def withdraw_topic(zk, layout: MetaqZkLayout, broker_id: int, topic: str) -> None:
    for path in topic_nodes(layout, broker_id, topic, 1):
        groups.delete_own(zk, path)


def publish_slave(zk, layout: MetaqZkLayout, broker_id: int, replica_id: int, uri: str, acl=None) -> bool:
    """``brokers/ids/<b>/slave<r>`` = ``uri`` (ephemeral), replacing one an older session of this member left;
    False when ``brokers/ids/<b>`` is an ephemeral node still (a master of the layout before issue 28)."""
    path = layout.broker_slave(broker_id, replica_id)
    try:
        ensure_broker(zk, layout, broker_id, acl)
        for _ in range(ATTEMPTS):
            t = zk.transaction()
            _put_ephemeral(zk, t, path, uri.encode(), acl)
            if _committed(t):
                return True
    except KazooException as e:  # NoChildrenForEphemeralsError: an old master's node; tried again at registration
        log.info("could not write %s: %s", path, type(e).__name__)
    return False


def withdraw_slave(zk, layout: MetaqZkLayout, broker_id: int, replica_id: int) -> None:
    groups.delete_own(zk, layout.broker_slave(broker_id, replica_id))


def forget(zk, layout: MetaqZkLayout, broker_id: int) -> bool:
    """Remove a broker group's ``brokers/ids/<b>`` for good (``metaq brokers --forget``): only when it has no
    live ``master`` or ``slave<n>``; True if removed or absent."""
    try:
        stat = zk.exists(layout.broker(broker_id))
        if stat is None:
            return True
        if stat.ephemeralOwner:
            return False  # a live broker of the layout before issue 28
        zk.delete(layout.broker(broker_id), version=stat.version)
        return True
    except NotEmptyError:
        return False
    except (NoNodeError, BadVersionError):
        return True


def _put_ephemeral(zk, t, path: str, data: bytes, acl) -> None:
    """Add to ``t`` what makes ``path`` this session's ephemeral node holding ``data``."""
    try:
        held, stat = zk.get(path)
    except NoNodeError:
        t.create(path, data, acl, ephemeral=True)
        return
    if stat.ephemeralOwner == zk.client_id[0]:
        if held != data:
            t.set_data(path, data, stat.version)
        return
    t.delete(path, stat.version)  # an older session's (a crashed run's, or a member that lost the election)
    t.create(path, data, acl, ephemeral=True)


def _committed(t) -> bool:
    """Commit ``t``; False when a node changed since it was read (the caller reads again and retries)."""
    results = t.commit()
    failures = [r for r in results if isinstance(r, Exception)]
    if not failures:
        return True
    real = [e for e in failures if not isinstance(e, (RolledBackError, RuntimeInconsistency))] or failures
    if isinstance(real[0], (BadVersionError, NodeExistsError, NoNodeError)):
        return False
    raise real[0]
