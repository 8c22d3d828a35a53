"""Consumer-group state in ZooKeeper (``<root>/consumers/<group>/...``), where MetaQ keeps it:

* ``metaq/offsets/<topic>/<brokerId>-<n>``: metaq's committed (logical) offset as ASCII decimal, so the
  tools can read it without a schema. One topic's offsets are written in one ZooKeeper transaction, so a
  commit is all-or-nothing.
* ``metaq/offsets/<topic>/<brokerId>-<n>/identity``: the identity of the partition log the offset was
  committed for (32 hex digits, ``store/identity.py``), written in the same transaction. An offset recorded
  for another log (a wiped data directory, a topic made again) is not applied to this one (``fetch`` with
  the partitions' identities leaves it out); an offset without one (committed before identities existed, or
  by a tool that does not know the log's) applies to any log.
* ``offsets/<topic>/<brokerId>-<n>``: MetaQ's node, ``<msgId>-<byteOffset>``, which MetaQ consumers read and
  write themselves; the partition's master keeps it and metaq's in step (``server/offset_bridge.py``).
  Before issue 28 metaq kept its own offsets there, as bare decimals: such an offset written after
  metaq's node (an older broker or client during a rolling upgrade) is the group's offset
  (``legacy_offset``), until it is copied over.
* ``ids/<consumerId>`` (ephemeral): a live member; data = its topics, comma-separated (as MetaQ's).
* ``owners/<topic>/<partition>`` (ephemeral): the member consuming that partition. Ephemeral so a
  member that dies frees its partitions when its session ends.

Balancing is MetaQ's/Kafka's range rule, which every member computes alone from the same sorted
inputs; the owner nodes make the hand-over safe while members disagree during a rebalance.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, Optional

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError, RolledBackError

from metaq_broker.errors import MetaqError
from metaq_broker.names import parse_partition_name
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths, check_component
from metaq_broker.zk.session import children

COMMIT_ATTEMPTS = 10
IDENTITY = "identity"  # child of an offset node: the partition log's identity it was committed for

log = logging.getLogger(__name__)


def _as_offset(data: bytes) -> int:
    """A recorded offset, or -1 for a node that holds no number (then any offset replaces it)."""
    try:
        return int(data)
    except ValueError:
        return -1


def legacy_offset(data) -> Optional[int]:
    """The offset in a bare ASCII decimal at MetaQ's offset node: metaq's own, as metaq kept it before issue
    28; None for anything else (MetaQ 1.4 clients write ``<msgId>-<offset>``; the bare byte offsets of
    MetaQ clients before 1.4 are not told apart from these, and are not supported)."""
    if isinstance(data, (bytes, bytearray)) and 0 < len(data) <= 19 and data.isdigit():
        return int(data)
    return None


class ConsumerIdInUseError(MetaqError):
    """Another live session already joined the group under this consumer id."""


class UnknownGroupError(MetaqError, LookupError):
    """No such consumer group in ZooKeeper."""


class GroupHasMembersError(MetaqError):
    """The operation would change a group under its live members' feet (Kafka refuses it too)."""


def range_assign(members: Iterable[str], partitions: Iterable[str], consumer_id: str) -> list:
    """``consumer_id``'s share: members sorted as strings, partitions by (brokerId, n); member i takes
    a contiguous run, and the first ``len(partitions) % len(members)`` members one extra."""
    members = sorted(set(members))
    if consumer_id not in members:
        return []
    parts = sorted(set(partitions), key=parse_partition_name)
    i, k = members.index(consumer_id), len(members)
    per, extra = divmod(len(parts), k)
    start = i * per + min(i, extra)
    return parts[start: start + per + (1 if i < extra else 0)]


class GroupStore:
    def __init__(self, zk: KazooClient, root: str = "/meta"):
        self.zk = zk
        self.root = root
        self.paths = ZkPaths(root)
        self.layout = MetaqZkLayout(root)

    # -- offsets --------------------------------------------------------------------------------------
    def commit(self, group: str, topic: str, offsets: dict, forward_only: bool = False,
               identities: Optional[dict] = None) -> dict:
        """Record ``{partition name: next offset to read}`` for the group, atomically for the topic. Each
        node is written with a check of the version read, so a concurrent writer makes the transaction
        retry instead of being overwritten blindly. ``forward_only``: a partition whose recorded offset is
        already at or above the new one keeps it, so writers that race (a Spark source's ``commit`` and
        its listener) can never move the group backwards; an offset of another log (``identities``
        differs from the recorded one) is not "above": it is replaced. ``identities``: ``{partition name:
        identity}`` of the logs the offsets are for; a partition without one has its recorded identity
        removed (the offset then applies to any log). Returns what was written."""
        identities = identities or {}
        values = {}
        for p, o in offsets.items():
            if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                raise ValueError(f"offset of partition {p} must be a non-negative integer, got {o!r}")
            values[self.paths.group_offset(group, topic, p)] = (p, o)
        if not values:
            return {}
        self.zk.ensure_path(self.paths.group_offsets(group, topic))
        for attempt in range(COMMIT_ATTEMPTS):  # another committer may change a node between read and commit
            tx, written = self.zk.transaction(), {}
            for path, (p, o) in values.items():
                ident = identities.get(p) or ""
                try:
                    data, stat = self.zk.get(path)
                except NoNodeError:
                    data = stat = None
                own, id_stat = self._identity(path) if stat is not None else ("", None)
                old, recorded = self._newer_legacy(group, topic, p, stat) or (
                    (_as_offset(data), own) if stat is not None else (-1, ""))
                if forward_only and old >= o and (not ident or not recorded or recorded == ident):
                    continue
                if stat is None:
                    tx.create(path, str(o).encode("ascii"))
                    if ident:
                        tx.create(f"{path}/{IDENTITY}", ident.encode("ascii"))
                    written[p] = o
                    continue
                tx.set_data(path, str(o).encode("ascii"), version=stat.version)
                if ident and id_stat is None:
                    tx.create(f"{path}/{IDENTITY}", ident.encode("ascii"))
                elif ident and own != ident:
                    tx.set_data(f"{path}/{IDENTITY}", ident.encode("ascii"), version=id_stat.version)
                elif not ident and id_stat is not None:
                    tx.delete(f"{path}/{IDENTITY}", version=id_stat.version)
                written[p] = o
            if not written:
                return {}
            failures = [r for r in tx.commit() if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
            if not failures:
                return written
            if not isinstance(failures[0], (NodeExistsError, NoNodeError, BadVersionError)) \
                    or attempt == COMMIT_ATTEMPTS - 1:
                raise failures[0]
        return {}

    def _identity(self, path: str) -> tuple:
        """(identity recorded with the offset at ``path`` or "", its node's stat or None)."""
        try:
            data, stat = self.zk.get(f"{path}/{IDENTITY}")
            return data.decode("ascii", "replace"), stat
        except NoNodeError:
            return "", None

    def _newer_legacy(self, group: str, topic: str, partition: str, than) -> Optional[tuple]:
        """(offset, identity) of a bare offset at MetaQ's node written after metaq's node (``than``, its stat or
        None: none), or None: an older broker or client committed it during a rolling upgrade."""
        path = self.layout.group_offset(group, topic, partition)
        try:
            data, stat = self.zk.get(path)
        except NoNodeError:
            return None
        offset = legacy_offset(data)
        if offset is None or (than is not None and stat.mzxid < than.mzxid):
            return None
        return offset, self._identity(path)[0]

    def fetch(self, group: str, topic: str, identities: Optional[dict] = None) -> dict:
        """``{partition name: committed offset}``; {} if the group never committed for the topic. With
        ``identities`` (``{partition name: identity}`` of the logs now), an offset recorded for another log
        of a partition is left out, with a warning: it means nothing in this one."""
        names = set(children(self.zk, self.paths.group_offsets(group, topic)))
        names |= set(children(self.zk, self.layout.group_offsets(group, topic)))  # bare offsets of older versions
        out = {}
        for p in names:
            if not _is_partition(p):
                continue  # not ours
            path = self.paths.group_offset(group, topic, p)
            try:
                data, stat = self.zk.get(path)
                offset, recorded = int(data), None
            except NoNodeError:
                stat = None
            except ValueError:
                continue  # not a number
            legacy = self._newer_legacy(group, topic, p, stat)
            if legacy is not None:
                offset, recorded = legacy
            elif stat is None:
                continue  # no offset of metaq's: MetaQ's <msgId>-<offset> alone (its master translates it)
            now = (identities or {}).get(p)
            if now:
                recorded = self._identity(path)[0] if recorded is None else recorded
                if recorded and recorded != now:
                    log.warning("group %s: the offset %d of %s %s was committed for another log of the partition "
                                "(identity %s; now %s: a wiped data directory or a topic made again); not "
                                "applied", group, offset, topic, p, recorded, now)
                    continue
            out[p] = offset
        return dict(sorted(out.items(), key=lambda kv: parse_partition_name(kv[0])))

    def groups(self) -> list:
        return sorted(children(self.zk, self.paths.consumers()))

    def group_topics(self, group: str) -> list:
        """Topics the group has committed offsets for (also MetaQ's offsets only, or an older version's)."""
        return sorted(set(children(self.zk, self.paths.group_offset_topics(group)))
                      | set(children(self.zk, self.layout.group_offset_topics(group))))

    def adopt_legacy(self, broker_id: int) -> int:
        """Copy into metaq's nodes the bare offsets (the layout before issue 28) of ``broker_id``'s partitions
        that are newer than metaq's, identities with them, each in one transaction; MetaQ's node keeps its
        data (the partition's master replaces it with MetaQ's form). Returns how many were copied."""
        prefix, copied = f"{int(broker_id)}-", 0
        for group in self.groups():
            for topic in children(self.zk, self.layout.group_offset_topics(group)):
                try:
                    names = [p for p in children(self.zk, self.layout.group_offsets(group, topic))
                             if p.startswith(prefix) and _is_partition(p)]
                except ValueError:
                    continue  # a topic name that cannot be ours
                for p in names:
                    copied += self._adopt(group, topic, p)
        return copied

    def _adopt(self, group: str, topic: str, partition: str) -> int:
        path = self.paths.group_offset(group, topic, partition)
        for _ in range(COMMIT_ATTEMPTS):
            try:
                stat = self.zk.exists(path)
                legacy = self._newer_legacy(group, topic, partition, stat)
                if legacy is None:
                    return 0
                offset, ident = legacy
                self.zk.ensure_path(self.paths.group_offsets(group, topic))
                tx = self.zk.transaction()
                if stat is None:
                    tx.create(path, str(offset).encode("ascii"))
                else:
                    tx.set_data(path, str(offset).encode("ascii"), version=stat.version)
                    own, id_stat = self._identity(path)
                    if id_stat is not None:
                        tx.delete(f"{path}/{IDENTITY}", version=id_stat.version)
                if ident:
                    tx.create(f"{path}/{IDENTITY}", ident.encode("ascii"))
                failures = [r for r in tx.commit() if isinstance(r, Exception)]
                if not failures:
                    return 1
            except (NoNodeError, NodeExistsError, BadVersionError):
                pass
        log.warning("group %s: could not copy the offset of %s %s from the layout before issue 28 (it changed "
                    "%d times meanwhile); readers still find it there", group, topic, partition, COMMIT_ATTEMPTS)
        return 0

    # -- membership -----------------------------------------------------------------------------------
    def join(self, group: str, consumer_id: str, topics: Iterable[str]) -> None:
        """Register this live member (ephemeral, gone with our session) and its topics."""
        topics = list(topics)
        for t in topics:
            if "," in check_component("topic", t):
                raise ValueError(f"topic {t!r} contains ','")
        path = self.paths.group_member(group, consumer_id)
        data = ",".join(topics).encode()
        self.zk.ensure_path(self.paths.group_ids(group))
        try:
            self.zk.create(path, data, ephemeral=True)
        except NodeExistsError:
            _, stat = self.zk.get(path)
            if stat.ephemeralOwner != self.zk.client_id[0]:
                raise ConsumerIdInUseError(f"consumer id {consumer_id!r} is already a member of group "
                                           f"{group!r} in another live session") from None
            self.zk.set(path, data)

    def leave(self, group: str, consumer_id: str, owned: Optional[dict] = None, timeout: float = 10.0) -> bool:
        """Give up the partitions this member owns (``{topic: [partition]}``) and its membership, waiting
        at most ``timeout`` seconds: a member closing while ZooKeeper is unreachable must still end (kazoo
        holds a call until it reconnects), and its nodes, ephemeral, go when its session expires instead.
        True if it left now."""
        deadline = time.monotonic() + timeout

        def wait(result):
            return result.get(timeout=max(deadline - time.monotonic(), 0.001))
        try:
            paths = [self.paths.group_owner(group, t, p) for t, parts in (owned or {}).items() for p in parts]
            reads = [(path, self.zk.get_async(path)) for path in paths]
            deletes = []
            for path, read in reads:
                try:
                    data, stat = wait(read)
                except NoNodeError:
                    continue
                if data.decode() == consumer_id:
                    deletes.append(self.zk.delete_async(path, version=stat.version))
            deletes.append(self.zk.delete_async(self.paths.group_member(group, consumer_id)))
            for d in deletes:
                try:
                    wait(d)
                except (NoNodeError, BadVersionError):
                    continue  # gone already, or another member's now
            return True
        except (KazooException, self.zk.handler.timeout_exception) as e:
            log.warning("group %s: member %s could not leave in ZooKeeper (%s: %s); its nodes go when its "
                        "session expires", group, consumer_id, type(e).__name__, e)
            return False

    def members(self, group: str, topic: Optional[str] = None) -> list:
        """Sorted consumer ids of live members (only those subscribed to ``topic`` if given)."""
        ids = sorted(children(self.zk, self.paths.group_ids(group)))
        if topic is None:
            return ids
        out = []
        for cid in ids:
            try:
                if topic in self.zk.get(self.paths.group_member(group, cid))[0].decode().split(","):
                    out.append(cid)
            except NoNodeError:
                continue
        return out

    # -- balancing ------------------------------------------------------------------------------------
    def assign(self, group: str, consumer_id: str, topic: str, partitions: Iterable[str]) -> list:
        """This member's share of ``partitions`` among the group's members subscribed to ``topic``."""
        return range_assign(self.members(group, topic), partitions, consumer_id)

    def owners(self, group: str, topic: str) -> dict:
        """``{partition name: owning consumer id}``."""
        out = {}
        for p in children(self.zk, self.paths.group_owners(group, topic)):
            try:
                out[p] = self.zk.get(self.paths.group_owner(group, topic, p))[0].decode()
            except (NoNodeError, ValueError):
                continue
        return out

    def claim(self, group: str, topic: str, partition: str, consumer_id: str) -> bool:
        """Take ownership of ``partition``: True if we own it now, False while another member does."""
        path = self.paths.group_owner(group, topic, partition)
        check_component("consumer id", consumer_id)
        self.zk.ensure_path(self.paths.group_owners(group, topic))
        while True:
            try:
                self.zk.create(path, consumer_id.encode(), ephemeral=True)
                return True
            except NodeExistsError:
                try:
                    return self.zk.get(path)[0].decode() == consumer_id
                except NoNodeError:
                    continue  # released meanwhile: try again

    def release(self, group: str, topic: str, partition: str, consumer_id: str) -> bool:
        """Give ``partition`` up if we own it; True if we did."""
        path = self.paths.group_owner(group, topic, partition)
        try:
            data, stat = self.zk.get(path)
            if data.decode() != consumer_id:
                return False
            self.zk.delete(path, version=stat.version)
            return True
        except (NoNodeError, BadVersionError):
            return False

    # -- whole groups (the ``metaq groups`` operations) -----------------------------------------------
    def exists(self, group: str) -> bool:
        return self.zk.exists(self.paths.group(group)) is not None

    def delete(self, group: str) -> None:
        """Remove the group: its offsets (metaq's and MetaQ's), owners and member nodes (a live member's too)."""
        try:
            self.zk.delete(self.paths.group(group), recursive=True)
        except NoNodeError:
            pass


class GroupOffsetWatcher:
    """Every group's committed offsets for the partitions of one broker (``<brokerId>-<n>``), kept in step
    with ZooKeeper for the broker's lag metrics (metaq's nodes) and its offset bridge (both trees). Each node
    read sets a one-shot watch that only marks the node stale; ``offsets()`` re-reads just the stale nodes,
    level by level, each level's reads sent together. So a scrape costs no ZooKeeper request when nothing was
    committed since the last one, and a group that commits a hundred times between two scrapes costs one read
    of each node it changed. A new session (the old one expired, and its watches with it) starts from a full
    read. ``tree``: whose offset nodes (``ZkPaths``, metaq's, by default; ``MetaqZkLayout``, MetaQ's)."""

    def __init__(self, zk: KazooClient, root: str, broker_id: int, tree=None):
        self.zk = zk
        self.paths = tree if tree is not None else ZkPaths(root)
        self.prefix = f"{int(broker_id)}-"
        self._lock = threading.Lock()  # guards _stale (watches fire on kazoo's thread)
        self._refresh_lock = threading.Lock()  # one refresh at a time (scrapes may run concurrently)
        self._stale: set = set()
        self._session = None
        self._keys: dict = {}  # watched path -> key
        self._children: dict = {}  # ("g",) | ("t", group) | ("p", group, topic) -> set of child names
        self._nodes: dict = {}  # (group, topic, partition) -> (data, mzxid) of its offset node
        self._changed: set = set()  # keys of _nodes changed since the last ``changes()``

    def offsets(self) -> dict:
        """``{(group, topic, partition): committed offset}`` for this broker's partitions (-1 for a node that
        holds no number); raises kazoo's errors when ZooKeeper cannot be read (the next call then reads
        everything again)."""
        with self._refresh_lock:
            self._update()
            return {k: _as_offset(data) for k, (data, _) in self._nodes.items()}

    def changes(self) -> dict:
        """``{(group, topic, partition): (data, mzxid) or None (gone)}`` of the nodes changed since the last
        call (every node after a new session)."""
        with self._refresh_lock:
            self._update()
            changed, self._changed = self._changed, set()
            return {k: self._nodes.get(k) for k in changed}

    def _update(self) -> None:
        if self._session != self.zk.client_id:
            with self._lock:
                self._stale = {("g",)}
            self._changed |= set(self._nodes)
            self._keys, self._children, self._nodes = {}, {}, {}
            self._session = self.zk.client_id
        with self._lock:
            stale, self._stale = self._stale, set()
        try:
            self._refresh(stale)
        except BaseException:
            self._session = None
            raise

    def _watch(self, event) -> None:
        key = self._keys.get(event.path)
        if key is not None:
            with self._lock:
                self._stale.add(key)

    def _path(self, key: tuple, watched: bool = True) -> str:
        path = {"g": self.paths.consumers, "t": self.paths.group_offset_topics, "p": self.paths.group_offsets,
                "o": self.paths.group_offset}[key[0]](*key[1:])
        if watched:
            self._keys[path] = key
        else:
            self._keys.pop(path, None)
        return path

    def _known(self, key: tuple) -> bool:
        """Still part of the tree (a watch of a node dropped since may fire later)."""
        if key == ("g",):
            return True
        parent = ({"t": "g", "p": "t", "o": "p"}[key[0]],) + key[1:-1]
        return key[-1] in self._children.get(parent, ())

    def _refresh(self, stale: set) -> None:
        pending = set(stale)
        for kind in "gtpo":
            level = [k for k in pending if k[0] == kind and self._known(k)]
            if kind == "o":
                calls = [(k, self.zk.get_async(self._path(k), watch=self._watch)) for k in level]
                for k, call in calls:
                    try:
                        data, stat = call.get()
                        self._nodes[k[1:]] = (data, stat.mzxid)
                    except NoNodeError:
                        self._nodes.pop(k[1:], None)  # the parent's watch drops it from the tree
                    self._changed.add(k[1:])
                continue
            calls = [(k, self.zk.get_children_async(self._path(k), watch=self._watch)) for k in level]
            child_kind = {"g": "t", "t": "p", "p": "o"}[kind]
            for k, call in calls:
                try:
                    names = set(call.get())
                except NoNodeError:
                    names = self._children_if_created(k)
                if kind == "p":
                    names = {n for n in names if n.startswith(self.prefix) and _is_partition(n)}
                old = self._children.get(k, set())
                self._children[k] = names
                for gone in old - names:
                    self._drop((child_kind,) + k[1:] + (gone,))
                pending.update((child_kind,) + k[1:] + (n,) for n in names - old)

    def _children_if_created(self, key: tuple) -> set:
        """The node is missing: watch for its creation (a group that has not committed yet)."""
        path = self._path(key)
        while self.zk.exists(path, watch=self._watch) is not None:
            try:
                return set(self.zk.get_children(path, watch=self._watch))
            except NoNodeError:
                continue
        return set()

    def _drop(self, key: tuple) -> None:
        for name in self._children.pop(key, ()):
            self._drop(({"t": "p", "p": "o"}[key[0]],) + key[1:] + (name,))
        if key[0] == "o" and self._nodes.pop(key[1:], None) is not None:
            self._changed.add(key[1:])
        self._path(key, watched=False)


def _is_partition(name: str) -> bool:
    try:
        parse_partition_name(name)
        return True
    except ValueError:
        return False
