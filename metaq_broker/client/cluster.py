"""Where brokers and partitions are, for clients: a read-only view of the cluster.

With ZooKeeper the view is a cache kept current by kazoo watches, so routing a message costs no
ZooKeeper round trip: a ChildrenWatch on ``brokers/metaq/ids`` plus a DataWatch per broker (address, and
whether it is alive), a ChildrenWatch on ``brokers/metaq/topics`` (topic names), and, for each topic a
caller asked about, a ChildrenWatch on its entries plus a DataWatch per ``<brokerId>-m`` entry (its
partition count). Topic entries are persistent, so a topic's partitions are those of entries whose
broker is alive. Kazoo re-arms all of these after reconnects and session expiry; ``zk/watches.py``'s
keep following when ZooKeeper lost its data (nodes written again with old zxids, roots missing).

The same watches follow the layout before issue 28 (``SOURCES``: master nodes with metaq's JSON at
``brokers/ids/<b>``, entries with metaq's JSON in ``topics-pub``), so a client upgraded first keeps
finding the brokers not upgraded yet in a rolling upgrade; a broker's node or entry in metaq's own
nodes wins over the older one.

Without ZooKeeper (a static broker list) the caller supplies how to learn topics and data ports (the
gRPC client asks the brokers): ``static_topics``, a callable returning {topic: [(brokerId, n)]}, and
``static_data``, a callable returning a broker's data address or None.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import re
import threading
import time
import weakref
from typing import Callable, Optional

from kazoo.exceptions import KazooException, NoAuthError

from metaq_broker.errors import AuthenticationError
from metaq_broker.zk import groups
from metaq_broker.zk.metaq_layout import MetaqZkLayout
from metaq_broker.zk.paths import ZkPaths
from metaq_broker.zk.session import client_subtrees, new_client, start_client
from metaq_broker.zk.watches import FollowingChildrenWatch, FollowingDataWatch

log = logging.getLogger(__name__)

# Views still open at interpreter exit are closed then, before kazoo's own exit hook joins its worker
# threads: with ZooKeeper gone, a watch callback waits for a reconnect that never comes, so without this a
# script that does not close its clients would never exit. atexit runs the hook registered last first,
# and kazoo registers one per client it starts, so ours is registered again after each start.
_OPEN: "weakref.WeakSet[ClusterView]" = weakref.WeakSet()


def _close_open_views() -> None:
    for view in list(_OPEN):
        view.close()


def _track(view: "ClusterView") -> None:
    _OPEN.add(view)
    atexit.unregister(_close_open_views)
    atexit.register(_close_open_views)


STATIC_TTL = 1.0  # seconds a ``static_topics`` map is reused before asking the brokers again
STATIC_DATA_TTL = 10.0  # seconds a ``static_data`` answer (or its failure) is reused before asking again
_TOPIC_ENTRY = re.compile(r"(0|[1-9][0-9]*)-m")
SOURCES = ("metaq", "legacy")  # metaq's own nodes, then the layout before issue 28 (by precedence)


class ClusterView:
    def __init__(self, zk_connect: Optional[str] = None, root: str = "/meta", brokers: Optional[dict] = None,
                 static_topics: Optional[Callable[[], dict]] = None,
                 static_data: Optional[Callable[[int], Optional[str]]] = None, timeout: float = 15.0,
                 zk_security=None):
        if (zk_connect is None) == (brokers is None):
            raise ValueError("give exactly one of zk_connect (ZooKeeper) or brokers (a static broker list)")
        self.root = root
        self.paths = ZkPaths(root)
        self.layout = MetaqZkLayout(root)
        self.zk = None
        self._static = {int(b): str(a) for b, a in (brokers or {}).items()}
        self._static_topics = static_topics
        self._static_cache: tuple = (float("-inf"), {})
        self._static_data = static_data
        self._static_data_cache: dict = {}  # brokerId -> (when asked, its data address or None)
        self._lock = threading.RLock()
        self._close_lock = threading.Lock()
        self._listeners: list = []
        self._brokers: dict = {}           # live brokerId -> "host:port"
        self._data: dict = {}              # live brokerId -> "host:dataPort" of brokers with a data port
        self._protocols: dict = {}         # live brokerId -> its securityProtocol (PLAINTEXT if unsaid)
        self._zk_acl: dict = {}            # live brokerId -> whether it keeps ZooKeeper protected (zk.auth)
        self._registrations: dict = {}     # brokerId -> {source: its master node's JSON}
        self._broker_watched: set = set()  # every (source, brokerId) registered at some time while this view ran
        self._last: dict = {}              # brokerId -> its last "host:port" (kept while it is down)
        self._last_data: dict = {}         # brokerId -> its last "host:dataPort", or None
        self._moved_listeners: list = []
        self._topic_names: list = []       # topics with entries in any source
        self._names: dict = {s: set() for s in SOURCES}  # source -> its topics
        self._wanted: set = set()          # topics a caller asked about (watched while they exist)
        self._topic_watch: dict = {}       # (source, topic) -> token of its current ChildrenWatch
        self._counts: dict = {}            # (source, topic) -> {brokerId: numPartitions}
        self._parts: dict = {}             # topic -> {brokerId: numPartitions}, by source precedence
        self._entry_watched: set = set()   # (source, topic, brokerId) with a DataWatch
        if zk_connect is not None:
            self.zk = new_client(zk_connect, security=zk_security)
            self.zk.share_below(*client_subtrees(root))  # group offsets and members, an admin's resets
            start_client(self.zk, zk_connect, timeout)
            _track(self)
            try:
                try:
                    self.zk.ensure_path(self.paths.broker_ids())  # a watch needs its node to exist
                    self.zk.ensure_path(self.paths.topics())
                except NoAuthError:
                    raise AuthenticationError(
                        f"ZooKeeper refused to create {self.paths.broker_ids()} (NoAuth): no broker has registered "
                        f"under {root} yet, which is protected by zk.auth; start a broker first or set zk.auth") from None
                for source in SOURCES:
                    if source == "legacy" and not self._ensure_legacy_roots():
                        continue
                    FollowingChildrenWatch(self.zk, self._ids_root(source),
                                           functools.partial(self._on_broker_ids, source))
                    FollowingChildrenWatch(self.zk, self._topics_root(source),
                                           functools.partial(self._on_topic_names, source))
            except BaseException:
                self.close()
                raise

    # -- queries --------------------------------------------------------------------------------------
    def brokers(self) -> dict:
        """{brokerId: "host:port"} of live brokers (the static list as given)."""
        if self.zk is None:
            return dict(self._static)
        with self._lock:
            return dict(self._brokers)

    def data_address(self, broker_id: int) -> Optional[str]:
        """``"host:dataPort"`` of a live broker that registered a data port (``dataport``), else None
        (no data port, not alive). A static list's broker answers for itself (``static_data``), asked at
        most every STATIC_DATA_TTL seconds."""
        if self.zk is None:
            return self._static_data_address(broker_id)
        with self._lock:
            return self._data.get(broker_id)

    def security_protocol(self, broker_id: int) -> Optional[str]:
        """The ``security.protocol`` a live broker registered (None: a static list, or not alive)."""
        with self._lock:
            return self._protocols.get(broker_id)

    def zk_protected(self) -> bool:
        """Whether a live broker registered that it protects ZooKeeper (``zk.auth``): a client without a
        ZooKeeper identity of its own then keeps group offsets and decision records through brokers."""
        with self._lock:
            return any(self._zk_acl.values())

    def topics(self) -> list:
        """Names of the topics any broker has registered (static: as ``static_topics`` reports)."""
        if self.zk is None:
            return sorted(self._static_map()) if self._static_topics else []
        with self._lock:
            return list(self._topic_names)

    def topic_partitions(self, topic: str) -> list:
        """Sorted (brokerId, partition number) pairs of ``topic`` on live brokers; [] if unknown."""
        if self.zk is None:
            return sorted(self._static_map().get(topic, [])) if self._static_topics else []
        self.paths.topic(topic)  # ValueError for a name that cannot be a topic
        self._want(topic)
        with self._lock:
            counts = dict(self._parts.get(topic, {}))
            alive = set(self._brokers)
        return sorted((b, n) for b, count in counts.items() if b in alive for n in range(count))

    def registered_partitions(self, topic: str) -> list:
        """Sorted (brokerId, partition number) pairs of every partition ``topic`` has, also those whose
        broker is down at the moment (topic entries are persistent; static list: as the brokers report).
        Key hashing and a query's initial offsets use this, so a broker being down moves no key and
        drops no partition."""
        if self.zk is None:
            return self.topic_partitions(topic)
        self.paths.topic(topic)
        self._want(topic)
        with self._lock:
            counts = dict(self._parts.get(topic, {}))
        return sorted((b, n) for b, count in counts.items() for n in range(count))

    def known(self, broker_id: int) -> bool:
        """Whether ``broker_id`` names a broker (group) this view has seen registered, live or not now, or
        a group with live members (electing a master): a call to it may wait for its (new) master instead
        of failing at once."""
        if self.zk is None:
            return broker_id in self._static
        with self._lock:
            if broker_id in self._last:
                return True
        try:
            return bool(groups.members(self.zk, self.paths, broker_id))  # a group between masters
        except KazooException:
            return False

    def group_members(self, broker_id: int) -> list:
        """[("host:port", "host:dataPort" or None)] of the live members of a replicated broker group, by
        replicaId (read from ZooKeeper now, not cached); [] for a broker that is no group or a static list."""
        if self.zk is None:
            return []
        out = []
        for _, info in sorted(groups.members(self.zk, self.paths, broker_id).items()):
            try:
                address, data_address = groups.addresses(info)
            except (TypeError, ValueError):
                address = ""
            if not address or not info.get("host"):
                log.warning("ignoring an unreadable member of broker group %d: %r", broker_id, info)
                continue
            out.append((address, data_address or None))
        return out

    def on_moved(self, callback: Callable[[int, str, Optional[str]], None]) -> None:
        """Call ``callback(brokerId, old address, old data port address or None)`` (on a kazoo thread) when
        a broker registers at an address other than its last one: a replicated group's new master."""
        self._moved_listeners.append(callback)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on a kazoo thread; it must not block) whenever brokers or watched topics
        change."""
        self._listeners.append(callback)

    def close(self) -> None:
        """Stops the ZooKeeper session; returns within seconds also when ZooKeeper is gone (pending
        watch callbacks then fail and end). Callers at once (a client's own thread and the exit hook) take
        turns: kazoo's second ``stop`` returns before the first has stopped the connection, and its
        ``close`` then raises "Cannot close connection until it is stopped"."""
        _OPEN.discard(self)
        if self.zk is not None:
            with self._close_lock:
                self.zk.stop()
                self.zk.close()

    def __enter__(self) -> "ClusterView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- where each source keeps what -------------------------------------------------------------------
    def _ids_root(self, source: str) -> str:
        return self.paths.broker_ids() if source == "metaq" else self.layout.broker_ids()

    def _topics_root(self, source: str) -> str:
        return self.paths.topics() if source == "metaq" else self.layout.topics_pub()

    def _entries(self, source: str, topic: str) -> str:
        return self.paths.topic(topic) if source == "metaq" else self.layout.topic_pub(topic)

    def _ensure_legacy_roots(self) -> bool:
        """The older layout's roots exist (a watch needs them); False when this client may not make them."""
        try:
            self.zk.ensure_path(self.layout.broker_ids())
            self.zk.ensure_path(self.layout.topics_pub())
            return True
        except NoAuthError:
            log.debug("not following the ZooKeeper layout before issue 28: %s may not be created here", self.root)
            return False

    # -- brokers --------------------------------------------------------------------------------------
    def _on_broker_ids(self, source: str, children) -> None:
        ids = {int(c) for c in children if c.isdigit()}  # skips e.g. master_config_checksum
        with self._lock:
            new = {b for b in ids if (source, b) not in self._broker_watched}
            self._broker_watched |= {(source, b) for b in new}
        # Each DataWatch follows its node for good (through deletes and re-creates) and alone keeps
        # _brokers, so the order in which the two kinds of watch fire cannot leave a stale entry.
        for bid in sorted(new):
            path = self.paths.broker(bid) if source == "metaq" else self.layout.broker(bid)
            FollowingDataWatch(self.zk, path, functools.partial(self._on_broker_data, source, bid))

    def _on_broker_data(self, source: str, bid: int, data, stat, event=None) -> None:
        info = None
        if data is not None and (source == "metaq" or stat.ephemeralOwner):  # MetaQ's persistent node is not one
            try:
                info = json.loads(data)
                if not isinstance(info, dict):
                    raise ValueError("not a JSON object")
            except ValueError:
                info = None
                if source == "metaq":
                    log.warning("ignoring broker %d: unreadable registration %r", bid, data[:200])
        with self._lock:
            regs = self._registrations.setdefault(bid, {})
            if info is None:
                regs.pop(source, None)
            else:
                regs[source] = info
            info = next((regs[s] for s in SOURCES if s in regs), None)
        self._apply_broker(bid, info)

    def _apply_broker(self, bid: int, info: Optional[dict]) -> None:
        address = data_address = protocol = None
        zk_acl = False
        if info is not None:
            try:
                address = f"{info['host']}:{int(info['port'])}"
                protocol = str(info.get("securityProtocol", "PLAINTEXT"))
                zk_acl = info.get("zkAcl") is True
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring broker %d: unreadable registration %r", bid, info)
            else:
                try:
                    if int(info.get("dataPort", 0)) > 0:
                        data_address = f"{info['host']}:{int(info['dataPort'])}"
                except (ValueError, TypeError):
                    log.warning("broker %d: unreadable dataPort in %r; fetching with FetchRaw", bid, info)
        with self._lock:
            old, old_data = self._last.get(bid), self._last_data.get(bid)
            if address is None:
                self._brokers.pop(bid, None)
                self._protocols.pop(bid, None)
                self._zk_acl.pop(bid, None)
            else:
                self._brokers[bid] = self._last[bid] = address
                self._protocols[bid] = protocol
                self._zk_acl[bid] = zk_acl
            if data_address is None:
                self._data.pop(bid, None)
            else:
                self._data[bid] = data_address
            if address is not None:
                self._last_data[bid] = data_address
        if address is not None and old is not None and old != address:
            for cb in list(self._moved_listeners):
                try:
                    cb(bid, old, old_data)
                except Exception:  # noqa: BLE001
                    log.exception("broker move listener failed")
        self._changed()

    # -- topics ---------------------------------------------------------------------------------------
    def _on_topic_names(self, source: str, children) -> None:
        with self._lock:
            self._names[source] = set(children)
            names = sorted(set().union(*self._names.values()))
            self._topic_names = names
            for key in list(self._topic_watch):
                if key[0] == source and key[1] not in children:  # deleted: its ChildrenWatch has stopped
                    del self._topic_watch[key]
            start = [t for t in children if t in self._wanted and (source, t) not in self._topic_watch]
        for t in start:
            self._watch_topic(source, t)
        self._changed()

    def _want(self, topic: str) -> None:
        with self._lock:
            if topic in self._wanted:
                return  # watched, or _on_topic_names starts the watch when the topic appears
            self._wanted.add(topic)
            present = [s for s in SOURCES if topic in self._names[s]]
        for source in present:
            self._watch_topic(source, topic)

    def _watch_topic(self, source: str, topic: str) -> None:
        token = object()
        with self._lock:
            if (source, topic) in self._topic_watch:
                return
            self._topic_watch[(source, topic)] = token
        FollowingChildrenWatch(self.zk, self._entries(source, topic),  # superseded: its callback stops it
                               functools.partial(self._on_topic_entries, source, topic, token))

    def _on_topic_entries(self, source: str, topic: str, token, children):
        with self._lock:
            if self._topic_watch.get((source, topic)) is not token:
                return False  # superseded: stop this watch
            ids = {int(m.group(1)) for m in map(_TOPIC_ENTRY.fullmatch, children) if m}
            new = [b for b in sorted(ids) if (source, topic, b) not in self._entry_watched]
            self._entry_watched.update((source, topic, b) for b in new)
        for bid in new:  # the entry's DataWatch alone keeps _parts: present with data, or absent
            FollowingDataWatch(self.zk, f"{self._entries(source, topic)}/{bid}-m",
                               functools.partial(self._on_topic_entry_data, source, topic, bid))

    def _on_topic_entry_data(self, source: str, topic: str, bid: int, data, stat, event=None) -> None:
        count = None
        if data is not None:
            try:
                count = int(json.loads(data)["numPartitions"])
            except (ValueError, KeyError, TypeError):
                if source == "metaq":  # MetaQ's own entries ({"numParts", "broker"}) are not metaq's
                    log.warning("ignoring topic %s on broker %d: unreadable entry %r", topic, bid, data[:200])
        with self._lock:
            counts = self._counts.setdefault((source, topic), {})
            if count is None or count <= 0:
                counts.pop(bid, None)
            else:
                counts[bid] = count
            merged = {}
            for s in reversed(SOURCES):
                merged.update(self._counts.get((s, topic), {}))
            self._parts[topic] = merged
        self._changed()

    # -- helpers --------------------------------------------------------------------------------------
    def _static_map(self) -> dict:
        at, cached = self._static_cache
        if time.monotonic() - at > STATIC_TTL:
            cached = self._static_topics()
            self._static_cache = (time.monotonic(), cached)
        return cached

    def _static_data_address(self, broker_id: int) -> Optional[str]:
        if self._static_data is None:
            return None
        now = time.monotonic()
        with self._lock:
            asked, found = self._static_data_cache.get(broker_id, (float("-inf"), None))
            if now - asked < STATIC_DATA_TTL:
                return found
            self._static_data_cache[broker_id] = (now, found)  # other threads use the old answer meanwhile
        found = self._static_data(broker_id)
        with self._lock:
            self._static_data_cache[broker_id] = (time.monotonic(), found)
        return found

    def _changed(self) -> None:
        for cb in list(self._listeners):
            try:
                cb()
            except Exception:  # noqa: BLE001 - one bad listener must not break the watches
                log.exception("cluster change listener failed")
