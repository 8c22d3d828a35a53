"""Consumer-group offsets in ZooKeeper that follow Spark's commit log, the last batch included.

Spark calls a Python source's ``commit(end)`` for batch N only when it plans batch N+1, so offsets
written from ``commit`` alone trail the checkpoint by a batch (an AvailableNow run never records its
last batch; an idle stream shows a lag that is not there). A ``StreamingQueryListener`` sees
``onQueryProgress`` after the batch's commit-log entry is written, so it records exactly the committed
batches: never one that failed or was not logged.

The listener runs in the driver's Python process, not in the process that holds the source, so it
cannot see the source's options. Each offset the source hands Spark therefore carries a small marker
(``"@metaq": {"zk", "root", "group"}``; no topic can be named ``@metaq``) that says where and for which
group to record it. Being part of the offsets, the marker is in the checkpoint, which is how a query
that names no group keeps the group it was given (``SourceOptions.default_group``) across restarts.
A query with ``commitOffsets=false`` carries no marker and is never recorded. Nor does the listener record a
secured query (TLS or SASL to the brokers, or ``metaq.zk.auth``; the marker says ``"secured": true``): it
would need credentials the checkpoint must not hold, so such a query's group offsets come from
``commit`` alone (through a broker, which checks the group's ACLs), a batch late.

Writes only move a partition's offset forward (``GroupStore.commit(forward_only=True)``, a versioned
ZooKeeper transaction): the source's ``commit`` and the listener write in no fixed order, and neither
ever writes a batch that is not in Spark's commit log."""
from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from typing import Optional

from pyspark.sql.streaming import StreamingQueryListener

from metaq_broker.security.settings import ZkSecurity
from metaq_broker.zk.group_offsets import GroupStore
from metaq_broker.zk.session import ZooKeeperUnavailableError, client_subtrees, new_client, start_client

log = logging.getLogger(__name__)

MARKER = "@metaq"
IDENTITIES = "@identity"  # {topic: {partition: identity of the log the offsets are of}} (planning.py)
RESTARTS = "@from"  # {topic: {partition: offset}}: the batch reads a new log of the partition from there
ATTEMPTS = 5  # a write that failed for a moment (a lost connection, a version race) is tried again
CONNECT_S = 10.0  # how long one connect to ZooKeeper may take
AWAY_S = 30.0  # after a connect that failed, the ensemble is not tried again for this long


def mark(offsets: dict, zk_connect: str, zk_root: str, group: Optional[str], secured: bool = False) -> dict:
    """``offsets`` with the recording marker first (``group`` None: no marker, nothing is recorded)."""
    if group is None:
        return offsets
    return {MARKER: {"group": group, "root": zk_root, "zk": zk_connect, **({"secured": True} if secured else {})},
            **offsets}


def unmark(offsets: Optional[dict]) -> Optional[dict]:
    """The topic offsets alone (no topic name starts with '@')."""
    if offsets is None or not any(t.startswith("@") for t in offsets):
        return offsets
    return {t: ps for t, ps in offsets.items() if not t.startswith("@")}


def identities_in(offsets: Optional[dict]) -> dict:
    """{topic: {partition: identity}} carried by offsets (none in a checkpoint from before identities)."""
    found = (offsets or {}).get(IDENTITIES)
    return found if isinstance(found, dict) else {}


class _Away(ZooKeeperUnavailableError):
    """ZooKeeper could not be reached a moment ago: not tried now (``_Recorder``)."""


class _Recorder:
    """One kazoo client per ZooKeeper ensemble, shared by every query of this process. An ensemble that
    could not be reached is not tried again for ``away_s``: each record meanwhile returns False at once.
    Without that, every progress event and every source ``commit`` waited ``ATTEMPTS`` connect timeouts
    (~50 s) while ZooKeeper was gone, stalling the stream, and Spark's listener bus held ``spark.stop()``
    that long for each event it still had queued. Nothing is lost by skipping: writes only move offsets
    forward, and the next record after ZooKeeper is back writes the newest ones."""

    def __init__(self, connect_s: float = CONNECT_S, away_s: float = AWAY_S):
        self._lock = threading.Lock()
        self._stores: dict = {}
        self._connect_s, self._away_s = connect_s, away_s
        self._away_until: dict = {}  # (zk_connect, root) -> monotonic time before which no connect is tried

    def _store(self, zk_connect: str, root: str, security: Optional[ZkSecurity]):
        with self._lock:
            key = (zk_connect, root)
            store = self._stores.get(key)
            if store is None:
                if time.monotonic() < self._away_until.get(key, 0.0):
                    raise _Away(f"ZooKeeper at {zk_connect} could not be reached a moment ago")
                # Bounded reconnects: a client whose ZooKeeper went away is dropped and made anew at the
                # next write, rather than retrying (and logging) forever in the driver.
                client = new_client(zk_connect, self._connect_s, security, reconnect_tries=3)
                client.share_below(*client_subtrees(root))
                try:
                    start_client(client, zk_connect, self._connect_s)
                except ZooKeeperUnavailableError:
                    self._away_until[key] = time.monotonic() + self._away_s
                    raise
                store = self._stores[key] = GroupStore(client, root)
            return store

    def _forget(self, zk_connect: str, root: str) -> None:
        with self._lock:
            store = self._stores.pop((zk_connect, root), None)
        if store is not None:
            store.zk.stop()
            store.zk.close()

    def record(self, zk_connect: str, root: str, group: str, offsets: dict,
               security: Optional[ZkSecurity] = None, identities: Optional[dict] = None) -> bool:
        """Write ``{topic: {partition: offset}}`` for ``group``, never lowering a recorded offset of the same
        log (the source's ``commit`` and the listener race), with the logs' ``identities`` ({topic:
        {partition: identity}}); retried, and a failure is logged, never raised: ZooKeeper being away must
        not fail or stall a stream (an unreachable ZooKeeper is not retried: see the class)."""
        for attempt in range(ATTEMPTS):
            try:
                store = self._store(zk_connect, root, security)
                for topic, parts in offsets.items():
                    store.commit(group, topic, {p: int(o) for p, o in parts.items()}, forward_only=True,
                                 identities=(identities or {}).get(topic, {}))
                return True
            except Exception as e:  # noqa: BLE001 - reported, never fatal
                self._forget(zk_connect, root)
                unreachable = isinstance(e, ZooKeeperUnavailableError)
                if unreachable or attempt == ATTEMPTS - 1:
                    if not isinstance(e, _Away):  # said once each time it goes away
                        log.warning("could not record offsets of group %s in ZooKeeper %s%s: %s%s", group, zk_connect,
                                    root, e, f"; not tried again for {self._away_s:.0f}s" if unreachable else "")
                    return False
                time.sleep(0.2 * 2 ** attempt)
        return False

    def close(self) -> None:
        for zk_connect, root in list(self._stores):
            self._forget(zk_connect, root)


RECORDER = _Recorder()
atexit.register(RECORDER.close)


def record_marked(offsets_json: Optional[str]) -> bool:
    """Record a source's end offsets as Spark reports them (JSON); False if they carry no marker."""
    if not offsets_json:
        return False
    try:
        offsets = json.loads(offsets_json)
    except ValueError:
        return False
    meta = offsets.get(MARKER) if isinstance(offsets, dict) else None
    if not isinstance(meta, dict) or meta.get("secured"):
        return False
    return RECORDER.record(meta["zk"], meta["root"], meta["group"], unmark(offsets),
                           identities=identities_in(offsets))


class GroupCommitListener(StreamingQueryListener):
    """Records every metaq source's end offsets once Spark has logged the batch as committed."""

    def onQueryStarted(self, event) -> None:
        pass

    def onQueryProgress(self, event) -> None:
        for source in event.progress.sources:
            record_marked(source.endOffset)

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        pass


def install(spark) -> None:
    """Add the listener to ``spark`` once, and before the process exits let Spark deliver the progress
    events it still holds (an AvailableNow script that ends right after its query must not lose the
    last batch's offsets)."""
    if getattr(spark, "_metaq_group_commit", None) is not None:
        return
    listener = GroupCommitListener()
    spark.streams.addListener(listener)
    spark._metaq_group_commit = listener
    atexit.register(_drain, spark)


def _drain(spark, timeout_ms: int = 10_000) -> None:
    """Wait until Spark's listener bus is empty (classic sessions; a no-op elsewhere)."""
    try:
        spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(timeout_ms)
    except Exception:  # noqa: BLE001 - the session may be stopped already; nothing left to deliver then
        pass
