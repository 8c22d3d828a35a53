"""What the console shows, gathered through the client (``Admin``, ``Consumer``) and the zk layer: one
snapshot of the cluster every few seconds by a sampler thread, rates from the difference of two
snapshots' counters, and a ring buffer of rates and lags for the charts. Pages read the last snapshot,
so a slow or dead broker delays the next snapshot, never an HTTP reply."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

from metaq_broker.client.admin import Admin, BrokerStatus
from metaq_broker.client.consumer import Consumer
from metaq_broker.errors import AuthorizationError
from metaq_broker.names import parse_partition_name

log = logging.getLogger(__name__)

RPC_TIMEOUT = 2.0  # seconds per broker call (the client tries 4 times): a dead broker stalls a snapshot ~8 s
MAX_BROWSE = 500  # messages per message-browser request
MAX_VALUE_SHOWN = 2048  # bytes of one key or value sent to the page (the rest is counted, not shown)

TXN_NOTE = ("No broker RPC lists open transactions (begun, not prepared): RecoverTransactions lists prepared "
            "ones. A partition whose log end is past its last stable offset holds an unsettled transaction "
            "(prepared, settling, or open with messages published after its first batch); it is listed with "
            "the offsets its readers are held back by.")


_NO_COUNTS = collections.namedtuple("Counts", "put_messages put_bytes get_messages")(0, 0, 0)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _shown(d: dict) -> list:
    """Messages (columns of a decoded batch, as lists) as the message browser shows them."""
    partitions = d.get("partition", [None] * len(d["offset"]))
    return [{"partition": p, "offset": o, "timestamp": ts.isoformat(timespec="milliseconds") + "Z" if ts else None,
             "key": show_bytes(k), "value": show_bytes(v), "msg_id": str(m), "flag": fl, "attribute": a}
            for p, o, k, v, ts, m, fl, a in zip(partitions, d["offset"], d["key"], d["value"], d["timestamp"],
                                                d["msgId"], d["flag"], d["attribute"])]


def show_bytes(data: Optional[bytes]) -> Optional[dict]:
    """A key or value for the page: ``{"text": ...}`` when it is UTF-8 without control characters (the
    page escapes it by setting it as text), else ``{"hex": ...}``; ``size`` always, cut to
    MAX_VALUE_SHOWN bytes."""
    if data is None:
        return None
    data = bytes(data)
    head = data[:MAX_VALUE_SHOWN]
    out = {"size": len(data), "truncated": len(data) > len(head)}
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        cut = out["truncated"] and e.reason == "unexpected end of data"  # a character split by the cut
        text = head[:e.start].decode("utf-8") if cut else None
    if text is not None and not any(c < " " and c not in "\t\n\r" or c == "\x7f" for c in text):
        out["text"] = text
    else:
        out["hex"] = head.hex(" ")
    return out


class Clients:
    """The console's Admin (and, for the message browser, a Consumer), made on first use and made again
    when making one failed (ZooKeeper not up yet)."""

    def __init__(self, zk_connect: Optional[str], zk_root: str, brokers: Optional[str], security=None):
        self.zk_connect, self.zk_root, self.brokers = zk_connect, zk_root, brokers
        self.security = security  # the clients' ClientSecurity (metaq --command-config), None: PLAINTEXT
        self._admin = self._consumer = None
        self._lock = threading.Lock()
        self._closed = False

    def _make(self, cls):
        kw = {"brokers": self.brokers} if self.brokers else {"zk_connect": self.zk_connect, "zk_root": self.zk_root}
        return cls(timeout=RPC_TIMEOUT, security=self.security, **kw)

    def _get(self, attr: str, cls):
        with self._lock:
            client = getattr(self, attr)
        if client is not None:
            return client
        client = self._make(cls)  # outside the lock: waits up to 15 s for ZooKeeper, close() must not
        with self._lock:
            if not self._closed and getattr(self, attr) is None:
                setattr(self, attr, client)
                return client
            made, client = client, getattr(self, attr)
        made.close()  # stopping, or another thread made one meanwhile
        if client is None:
            raise RuntimeError("the console is stopping")
        return client

    def admin(self) -> Admin:
        return self._get("_admin", Admin)

    def consumer(self) -> Consumer:
        return self._get("_consumer", Consumer)

    def zk_state(self) -> Optional[str]:
        """The ZooKeeper session's state now (kazoo's CONNECTED, SUSPENDED, LOST), never blocking; None
        before the first client or with a static broker list."""
        with self._lock:
            admin = self._admin
        return None if admin is None or admin.cluster.zk is None else admin.cluster.zk.state

    def describe_target(self) -> str:
        return f"brokers {self.brokers}" if self.brokers else f"ZooKeeper {self.zk_connect}, root {self.zk_root}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._admin, self._consumer = [self._admin, self._consumer], None, None
        for c in clients:
            if c is not None:
                c.close()


class Collector:
    """Takes snapshots (``collect``) and keeps the last one, the rates and the history. ``as_user``: the
    clients are a logged-in person's, so the snapshot holds what their ACLs let them see: the topics the
    brokers list to them (``ListTopics``), not every topic ZooKeeper's registrations name; a broker that
    refuses them its cluster statistics is asked per topic."""

    def __init__(self, clients: Clients, interval: float = 2.0, history_seconds: float = 600.0,
                 clock=time.time, as_user: bool = False):
        self.clients = clients
        self.as_user = as_user
        self.interval = interval
        self.clock = clock
        self.history: collections.deque = collections.deque(maxlen=max(2, int(history_seconds / interval) + 1))
        self._counters: dict = {}  # (topic, partition) -> (time, put_messages, put_bytes, get_messages)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._collecting_since: Optional[float] = None  # monotonic time the snapshot under way began
        self.snapshot: dict = {"time": None, "interval": interval, "target": clients.describe_target(),
                               "connecting": True, "errors": [], "brokers": [], "members": [], "topics": [],
                               "groups": [],
                               "transactions": {"prepared": [], "unsettled": [], "note": TXN_NOTE}}

    # -- the sampler thread -----------------------------------------------------------------------------
    def start(self) -> "Collector":
        self._thread = threading.Thread(target=self._run, name="metaq-console-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)  # daemon: one stuck in a broker call does not hold the exit

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._collecting_since = time.monotonic()
            try:
                self.collect()
            except Exception as e:  # noqa: BLE001 - the sampler must keep running; the page shows it
                log.exception("console snapshot failed")
                self._publish({**self.snapshot, "errors": [_error(e)]})
            finally:
                self._collecting_since = None
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _publish(self, snap: dict) -> None:
        with self._lock:
            self.snapshot = snap

    def latest(self) -> dict:
        """The last snapshot, with what is known now added: a ZooKeeper read waits for as long as
        ZooKeeper is gone (kazoo queues it), so the snapshot under way may be stuck."""
        with self._lock:
            snap = self.snapshot
        extra = []
        state = self.clients.zk_state()
        if snap.get("zookeeper") and state and state != snap["zookeeper"]["state"]:
            snap = {**snap, "zookeeper": {**snap["zookeeper"], "state": state}}
        if state not in (None, "CONNECTED") and not any("is not connected" in e for e in snap["errors"]):
            extra.append(f"ZooKeeper {self.clients.zk_connect} is not connected ({state}): the figures are "
                         f"from before it went away")
        since = self._collecting_since
        if since is not None and time.monotonic() - since > max(5.0, 3 * self.interval):
            extra.append(f"the next snapshot has waited {time.monotonic() - since:.0f}s for ZooKeeper or a broker")
        return {**snap, "errors": snap["errors"] + extra} if extra else snap

    def series(self) -> dict:
        with self._lock:
            return {"interval": self.interval, "now": self.clock(), "samples": list(self.history)}

    # -- one snapshot -----------------------------------------------------------------------------------
    def collect(self) -> dict:
        now = self.clock()
        snap = {"time": now, "interval": self.interval, "target": self.clients.describe_target(),
                "connecting": False, "errors": [], "zookeeper": None, "brokers": [], "members": [], "topics": [],
                "groups": [],
                "transactions": {"prepared": [], "unsettled": [], "errors": [], "note": TXN_NOTE}}
        try:
            admin = self.clients.admin()
        except Exception as e:  # noqa: BLE001 - no ZooKeeper yet: say so, try again next time
            snap["errors"].append(f"cannot reach the cluster ({self.clients.describe_target()}): {_error(e)}")
            self._publish(snap)
            return snap
        zk = admin.cluster.zk
        zk_ok = zk is None or zk.state == "CONNECTED"
        if zk is not None:
            snap["zookeeper"] = {"connect": self.clients.zk_connect, "root": self.clients.zk_root, "state": zk.state}
            if not zk_ok:
                snap["errors"].append(f"ZooKeeper {self.clients.zk_connect} is not connected ({zk.state}): brokers "
                                      f"and topics are as last seen, consumer groups cannot be read")
        stats, denied = self._brokers(admin, snap, zk_ok)
        visible = None
        if self.as_user:
            try:
                visible = set(admin.listed_topics())
            except Exception as e:  # noqa: BLE001 - shown; nothing is listed rather than everything
                snap["errors"].append(f"listing the topics you may see: {_error(e)}")
                visible = set()
        self._topics(admin, snap, stats, denied, now, visible)
        if zk is None:
            snap["errors"].append("consumer groups live in ZooKeeper: start the console with --zk to see them")
        elif zk_ok:
            self._groups(admin, snap)
        snap["took"] = self.clock() - now
        self._record(snap)
        self._publish(snap)
        return snap

    def _brokers(self, admin: Admin, snap: dict, zk_ok: bool) -> tuple:
        """Fills ``snap["brokers"]`` and prepared transactions; returns ({brokerId: StatsResponse} of the
        brokers that answered, {brokerIds that answered but refused the cluster's statistics to this
        principal}). ``Admin.brokers_status`` (live, and restarted ones still waiting for their
        old ZooKeeper session) while ZooKeeper is connected, else ``Admin.masters`` (live ones, from the
        client's cached view: reading ZooKeeper now would wait until it is back). Each broker's group
        members (``Admin.brokers``: role, epoch, in sync, lag) go in ``snap["members"]``."""
        stats, denied = {}, set()
        now = self.clock()
        try:
            if zk_ok:
                listed = admin.brokers_status()
            else:
                listed = [BrokerStatus(bid, addr, "live") for bid, addr in sorted(admin.masters().items())]
        except Exception as e:  # noqa: BLE001
            snap["errors"].append(f"listing brokers: {_error(e)}")
            return stats, denied
        try:
            snap["members"] = admin.brokers() if zk_ok else []
        except Exception as e:  # noqa: BLE001
            snap["errors"].append(f"listing broker group members: {_error(e)}")
        for st in listed:
            bid = st.broker_id
            row = {"id": bid, "address": st.address, "state": st.state, "status": st.describe(now),
                   "data_address": admin.data_address(bid), "version": None, "uptime": None, "error": None,
                   "details": {k: v for k, v in (("since", st.since), ("expected_expiry", st.expected_expiry))
                               if v is not None}}
            snap["brokers"].append(row)
            if row["state"] != "live":
                continue  # a starting broker answers nothing until it is registered
            try:
                s = admin.stats(bid)
                stats[bid] = s
                row["version"], row["uptime"] = s.version, s.uptime_seconds
            except AuthorizationError as e:  # it answered: the ACLs keep its cluster figures from this user
                row["error"] = _error(e)
                denied.add(bid)
                continue
            except Exception as e:  # noqa: BLE001 - a broker down or waiting: show it, go on
                row["error"] = _error(e)
                row["status"] = "not answering"
                continue
            try:
                for t in admin.prepared_transactions(bid):
                    snap["transactions"]["prepared"].append({
                        "broker_id": bid, "xid": t.xid, "coordinator": t.coordinator, "messages": t.messages,
                        "prepared_seconds_ago": t.prepared_seconds_ago})
            except Exception as e:  # noqa: BLE001
                snap["transactions"]["errors"].append(f"broker {bid}: {_error(e)}")
        return stats, denied

    def _topics(self, admin: Admin, snap: dict, stats: dict, denied: set, now: float,
                visible: Optional[set] = None) -> None:
        """Fills ``snap["topics"]``: every registered topic, or those in ``visible`` (a user's)."""
        counters = {(p.topic, p.partition): p for s in stats.values() for p in s.partitions}
        live = set(admin.cluster.brokers())
        # registered but not answering Stats (or starting): not asked again in this snapshot
        answered = set(stats) | denied
        silent = {b["id"]: b["status"] for b in snap["brokers"] if b["id"] in live and b["id"] not in answered}
        silent.update((bid, "not answering") for bid in live - answered - set(silent))
        for topic in sorted(admin.cluster.topics()):
            if visible is not None and topic not in visible:
                continue
            t = {"topic": topic, "error": None, "partitions": []}
            snap["topics"].append(t)
            try:
                names = admin.registered_partitions(topic)
            except Exception as e:  # noqa: BLE001
                t["error"] = _error(e)
                continue
            by_broker: dict = {}
            for name in names:
                by_broker.setdefault(parse_partition_name(name)[0], []).append(name)
            described, bounds, errors = {}, {}, []
            if set(silent) & set(by_broker):
                errors.extend(f"broker {b}: {silent[b]}" for b in sorted(set(silent) & set(by_broker)))
            else:
                try:
                    described = {p.partition: p for p in admin.describe(topic)}
                except Exception as e:  # noqa: BLE001
                    errors.append(f"describe: {_error(e)}")
            for bid, parts in sorted(by_broker.items()):
                if bid not in live or bid in silent:
                    continue
                try:
                    bounds.update(admin.offset_bounds(topic, parts))
                    if bid in denied:  # the cluster's counters were refused: this topic's, on their own
                        counters.update(((p.topic, p.partition), p) for p in admin.stats(bid, topic).partitions)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"offsets on broker {bid}: {_error(e)}")
            t["error"] = "; ".join(errors) or None
            for name in names:
                bid = parse_partition_name(name)[0]
                d, b = described.get(name), bounds.get(name)
                row = {"partition": name, "broker_id": bid, "state": "broker down" if bid not in live else
                       silent[bid] if bid in silent else "closed" if d is not None and d.closed else "open",
                       "earliest": b[0] if b else None, "last_stable": b[1] if b else None,
                       "log_end": b[2] if b else None, "bytes": d.bytes if d else None,
                       "segments": d.segments if d else None}
                c = counters.get((topic, name))
                if c is None and bid in answered:  # the broker answered: no counters yet means none counted
                    c = _NO_COUNTS
                row.update(self._rates(topic, name, c, now))
                t["partitions"].append(row)
                if b and b[2] > b[1]:
                    snap["transactions"]["unsettled"].append({
                        "topic": topic, "partition": name, "last_stable": b[1], "log_end": b[2],
                        "held_back": b[2] - b[1]})
            for key in ("bytes", "produce_rate", "produce_bytes_rate", "fetch_rate"):
                values = [p[key] for p in t["partitions"] if p[key] is not None]
                t[key] = sum(values) if values else None
            t["messages"] = sum(p["last_stable"] - p["earliest"] for p in t["partitions"] if p["earliest"] is not None)

    def _rates(self, topic: str, name: str, c, now: float) -> dict:
        """Messages and bytes a second since the previous snapshot, from the broker's cumulative Stats
        counters; None for the first snapshot and after a broker restart (counters start again)."""
        out = {"produce_rate": None, "produce_bytes_rate": None, "fetch_rate": None}
        if c is None:
            return out
        cur = (now, c.put_messages, c.put_bytes, c.get_messages)
        prev = self._counters.get((topic, name))
        self._counters[(topic, name)] = cur
        if prev is None or cur[0] <= prev[0] or any(a < b for a, b in zip(cur[1:], prev[1:])):
            return out
        dt = cur[0] - prev[0]
        out["produce_rate"] = (cur[1] - prev[1]) / dt
        out["produce_bytes_rate"] = (cur[2] - prev[2]) / dt
        out["fetch_rate"] = (cur[3] - prev[3]) / dt
        return out

    def _groups(self, admin: Admin, snap: dict) -> None:
        """Every group with its members and lag (``Admin.describe_groups``: through a broker, so only what
        the principal may Describe, when the clients are secured)."""
        try:
            views = admin.describe_groups()
        except Exception as e:  # noqa: BLE001
            snap["errors"].append(f"listing consumer groups: {_error(e)}")
            return
        for view in views:
            g = view.group
            group = {"group": g, "members": view.members, "topics": [], "lag": 0, "error": None}
            snap["groups"].append(group)
            for topic, (committed, owners) in sorted(view.topics.items()):
                entry = {"topic": topic, "lag": 0, "partitions": [], "error": None}
                group["topics"].append(entry)
                try:
                    rows = admin.lag_of(g, topic, committed)
                except Exception as e:  # noqa: BLE001 - e.g. the topic is gone, or its broker is down
                    entry["error"] = _error(e)
                    continue
                for r in rows:
                    entry["partitions"].append({"partition": r.partition, "committed": r.committed,
                                                "latest": r.latest, "lag": r.lag, "owner": owners.get(r.partition)})
                entry["lag"] = sum(r.lag for r in rows)
            group["lag"] = sum(t["lag"] for t in group["topics"])

    def _record(self, snap: dict) -> None:
        sample = {"t": snap["time"],
                  "topics": {t["topic"]: [t.get("produce_rate"), t.get("fetch_rate")] for t in snap["topics"]},
                  "lag": {f"{g['group']} / {t['topic']}": t["lag"] for g in snap["groups"] for t in g["topics"]
                          if t["error"] is None}}
        with self._lock:
            self.history.append(sample)

    # -- the message browser ----------------------------------------------------------------------------
    def browse(self, topic: str, partition: str, start: Optional[int], count: int) -> dict:
        """Up to ``count`` committed messages of one partition from ``start`` (default: the last ``count``
        before the last stable offset), fetched now with the Consumer."""
        count = max(1, min(int(count), MAX_BROWSE))
        consumer = self.clients.consumer()
        earliest, last_stable, log_end = consumer.offset_bounds(topic, [partition])[partition]
        if start is None:
            start = max(earliest, last_stable - count)
        out = {"topic": topic, "partition": partition, "earliest": earliest, "last_stable": last_stable,
               "log_end": log_end, "from": start, "messages": [], "next": start}
        if start >= last_stable:
            return out
        f = consumer.fetch(topic, partition, start, max_bytes=4 << 20, max_messages=count)
        out["next"] = f.next_offset
        out["messages"] = _shown(f.batch.to_pydict())  # at most MAX_BROWSE rows: shown one by one anyway
        return out

    def find(self, topic: str, key: Optional[str], msg_id: Optional[int], partition: Optional[str],
             count: int) -> dict:
        """The messages of ``topic`` with ``key`` (UTF-8), newest first, at most ``count``, or the one with
        ``msg_id``; in ``partition`` or all: the brokers' lookups (``Consumer.lookup_arrow``)."""
        count = max(1, min(int(count), MAX_BROWSE))
        table = self.clients.consumer().lookup_arrow(topic, key=key, msg_id=msg_id, max_messages=count,
                                                      partitions=[partition] if partition else None)
        return {"topic": topic, "key": key, "msg_id": None if msg_id is None else str(msg_id),  # ids pass 2^53
                "partition": partition, "messages": _shown(table.to_pydict())}
