"""Consumer-group offsets readable by both metaq and MetaQ clients (docs/protocol.md, "Group offsets in two
forms"): the master of a broker group with a MetaQ listener keeps, for each group's offset of each of its
partitions, metaq's node (``consumers/<g>/metaq/offsets/<t>/<p>``: the logical offset) and MetaQ's
(``consumers/<g>/offsets/<t>/<p>``: ``<msgId>-<bytePosition>``) in step.

Only a partition's master can map the two (``metaq_positions.py`` reads its log), and MetaQ consumers write
their node themselves, in ZooKeeper, so the bridge follows both trees with watches (``GroupOffsetWatcher``:
a change costs one read) and, for each changed partition, writes the node written last into the other,
both in one ZooKeeper transaction with a version check on each node, so a commit made meanwhile wins and is
bridged next. A bridged pair was written by one transaction, so its two nodes have the same ``mzxid``:
that is how a pair in step is told from a pair one side of which changed since, and why the bridge never
answers its own writes. A bare decimal in MetaQ's node is metaq's own offset of the layout before issue 28
(an older broker or client in a rolling upgrade) and is bridged like metaq's node. An offset committed for
another log of the partition (its identity differs) is not turned into a MetaQ position.

What a reader of either form sees of the other: within about ``INTERVAL_S`` of the commit while the master
is up; nothing while no master with a MetaQ listener runs (the next one bridges what changed meanwhile)."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError, RolledBackError

from metaq_broker.errors import MetaqError
from metaq_broker.names import parse_partition_name
from metaq_broker.server import metaq_positions
from metaq_broker.zk.group_offsets import IDENTITY, GroupOffsetWatcher, legacy_offset
from metaq_broker.zk.metaq_layout import MetaqZkLayout, format_group_offset, parse_group_offset
from metaq_broker.zk.paths import ZkPaths

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the bridge looks for changed offsets (each look costs no request when none changed)


class OffsetBridge:
    """``store``: the broker's; ``zk()``: its registration's client while connected, else None;
    ``is_master()``: whether this member may write its partitions' offsets now."""

    def __init__(self, store, broker_id: int, root: str, zk: Callable[[], Optional[object]],
                 is_master: Callable[[], bool], interval_s: float = INTERVAL_S):
        self.store, self.broker_id, self.root = store, broker_id, root
        self.paths, self.layout = ZkPaths(root), MetaqZkLayout(root)
        self._zk, self._is_master, self.interval_s = zk, is_master, interval_s
        self._watchers: Optional[tuple] = None
        self._retry: set = set()  # keys whose last bridging lost a race: looked at again next round
        self._warned: set = set()
        self.bridged = 0  # pairs written (tests, diagnosis)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "OffsetBridge":
        self._thread = threading.Thread(target=self._run, name=f"metaq-offset-bridge-{self.broker_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            zk = self._zk()
            if zk is None or not self._is_master():
                continue  # the watchers keep what changed meanwhile: the next master round reads it
            try:
                self.run_once(zk)
            except KazooException as e:
                log.debug("offset bridge of broker %d: ZooKeeper trouble (%s)", self.broker_id, e)
            except Exception:  # noqa: BLE001 - keep bridging
                log.exception("offset bridge of broker %d failed", self.broker_id)

    def run_once(self, zk) -> int:
        """Bridge every pair changed since the last round; returns how many pairs were written."""
        if self._watchers is None or self._watchers[0].zk is not zk:
            self._watchers = (GroupOffsetWatcher(zk, self.root, self.broker_id),
                              GroupOffsetWatcher(zk, self.root, self.broker_id, tree=self.layout))
        keys = set(self._retry)
        for watcher in self._watchers:
            keys |= set(watcher.changes())
        self._retry = set()
        written = 0
        for key in sorted(keys):
            try:
                written += self._bridge(zk, *key)
            except (BadVersionError, NodeExistsError, NoNodeError):
                self._retry.add(key)  # a commit came in between: bridged next round
        self.bridged += written
        return written

    def _bridge(self, zk, group: str, topic: str, partition: str) -> int:
        try:
            part = self.store.partition(topic, parse_partition_name(partition)[1])
        except (MetaqError, ValueError):
            return 0  # a topic this broker does not have (any more)
        ours_path, theirs_path = (self.paths.group_offset(group, topic, partition),
                                  self.layout.group_offset(group, topic, partition))
        ours, ours_stat = _get(zk, ours_path)
        theirs, theirs_stat = _get(zk, theirs_path)
        if ours_stat is None and theirs_stat is None:
            return 0
        if ours_stat is not None and theirs_stat is not None and ours_stat.mzxid == theirs_stat.mzxid:
            return 0  # in step: written together
        for path in (ours_path, theirs_path):
            zk.ensure_path(path.rsplit("/", 1)[0])
        t = zk.transaction()
        if theirs_stat is not None and (ours_stat is None or theirs_stat.mzxid > ours_stat.mzxid):
            offset, identity = self._from_metaq_form(zk, group, topic, partition, part, theirs, theirs_path)
            if offset is None:
                return 0
            _write(t, ours_path, str(offset).encode("ascii"), ours_stat)
            self._write_identity(zk, t, ours_path, ours_stat, identity)
            form = format_group_offset(*reversed(metaq_positions.position_of(part, offset)))
            _write(t, theirs_path, form if legacy_offset(theirs) is not None else theirs, theirs_stat)
        else:
            offset = _number(ours)
            recorded = _get(zk, f"{ours_path}/{IDENTITY}")[0]
            if offset is None or (recorded and recorded.decode("ascii", "replace") != part.identity):
                return self._warn_once((group, topic, partition), "not a MetaQ position: %s %s of group %s holds %r "
                                       "(for another log of the partition, or not a number)", topic, partition,
                                       group, ours)
            position, msg_id = metaq_positions.position_of(part, offset)
            _write(t, theirs_path, format_group_offset(msg_id, position), theirs_stat)
            _write(t, ours_path, ours, ours_stat)  # the pair's mzxids equal: in step
        results = t.commit()
        failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if failures:
            raise failures[0]
        return 1

    def _from_metaq_form(self, zk, group, topic, partition, part, data: bytes, path: str) -> tuple:
        """(logical offset, identity or "") of MetaQ's node: a bare decimal of the layout before issue 28 (with
        its identity), else ``<msgId>-<position>`` mapped on this log; (None, "") when it is neither."""
        offset = legacy_offset(data)
        if offset is not None:
            identity = _get(zk, f"{path}/{IDENTITY}")[0]
            return offset, (identity or b"").decode("ascii", "replace")
        try:
            msg_id, position = parse_group_offset(data)
        except ValueError as e:
            self._warn_once((group, topic, partition), "%s", e)
            return None, ""
        return metaq_positions.offset_at(part, msg_id, position), part.identity

    def _write_identity(self, zk, t, path: str, stat, identity: str) -> None:
        child = f"{path}/{IDENTITY}"
        held, held_stat = _get(zk, child) if stat is not None else (None, None)
        if identity and held_stat is None:
            t.create(child, identity.encode("ascii"))
        elif identity and held != identity.encode("ascii"):
            t.set_data(child, identity.encode("ascii"), version=held_stat.version)
        elif not identity and held_stat is not None:
            t.delete(child, version=held_stat.version)

    def _warn_once(self, key, message, *args) -> int:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("offset bridge: " + message, *args)
        return 0


def _get(zk, path: str) -> tuple:
    try:
        return zk.get(path)
    except NoNodeError:
        return None, None


def _write(t, path: str, data: bytes, stat) -> None:
    if stat is None:
        t.create(path, data)
    else:
        t.set_data(path, data, version=stat.version)


def _number(data) -> Optional[int]:
    try:
        value = int(data)
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None
