"""Broker transactions over the message store: MetaQ's local/XA transactions.

A transaction's messages go to a journal (MetaQ's ``dataLogPath``), never to a partition, until commit,
so no reader can see them. ``prepare`` fsyncs the journal: a prepared transaction survives a crash.
``commit`` first journals (fsynced) the decision with each partition's end offset, then appends the
messages, every partition's share in one atomic, fsynced append whose batch headers carry the
transaction's number. Recovery finishes a commit cut short by a crash: it counts the batches with that
number past the recorded offsets, so nothing is appended twice. Commit and rollback are idempotent.

Journal record: ``u32 payload length | u32 CRC-32C of (type, payload) | u8 type | payload``; payloads are
JSON, except PUT: ``u32 JSON length | JSON | batch body``. A torn tail is cut like a torn log tail;
damage followed by valid records refuses to open. docs/storage-format.md has the byte layout."""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from metaq_broker.errors import CorruptLogError, TransactionError, UnknownTransactionError
from metaq_broker.protocol import records
from metaq_broker.store.durable import make_dirs

log = logging.getLogger(__name__)

JOURNAL = "transactions.journal"
RECORD = struct.Struct("<IIB")
PUT, PREPARE, COMMIT, DONE, ROLLBACK, FINISHED = 1, 2, 3, 4, 5, 6
MAX_XID_BYTES = 255
KEEP_FINISHED = 100_000  # coordinator-less outcomes remembered so that a repeated commit/rollback succeeds
COMPACT_BYTES = 64 << 20


@dataclass
class _Put:
    topic: str
    partition: int
    count: int
    attributes: int
    crc: int
    position: int  # of the body in the journal
    size: int


@dataclass
class Transaction:
    xid: str
    state: str  # open | prepared | committing
    timeout_s: float
    coordinator: str = ""
    started: float = field(default_factory=time.monotonic)
    prepared_at: float = 0.0  # wall-clock seconds
    puts: list = field(default_factory=list)
    number: int = 0  # stamped in committed batch headers
    before: dict = field(default_factory=dict)  # "topic/partition" -> latest offset before commit
    applied: set = field(default_factory=set)  # partitions the commit reached in this process

    @property
    def messages(self) -> int:
        return sum(p.count for p in self.puts)


def check_xid(xid: str) -> str:
    if not isinstance(xid, str) or not xid or len(xid.encode()) > MAX_XID_BYTES:
        raise TransactionError(f"a transaction id must be 1 to {MAX_XID_BYTES} bytes, got {xid!r}")
    return xid


def _record_path(coordinator: str) -> str:
    """The decision record a coordinator names ("" for none or one that is not JSON with a path)."""
    try:
        m = json.loads(coordinator) if coordinator else None
    except ValueError:
        return ""
    return m["path"] if isinstance(m, dict) and isinstance(m.get("path"), str) else ""


class TransactionManager:
    def __init__(self, store, directory: Path, default_timeout_s: float = 60.0, clock=time.monotonic,
                 max_timeout_s: float = 900.0):
        self.store = store
        self.path = Path(directory) / JOURNAL
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._live: dict = {}
        self._finished: OrderedDict = OrderedDict()  # xid -> "committed" | "rolled_back" (LRU, KEEP_FINISHED)
        # Outcomes of transactions begun with a decision record: kept while the record exists (a replay of
        # the record asks for them), xid -> [outcome, record path]; ``forget_decided`` drops them.
        self._decided: dict = {}
        self._forgot_commits = False  # a committed outcome left the LRU: an unknown xid may be committed
        self._next_number = 1
        make_dirs(self.path.parent)
        self._recover()

    # -- API ------------------------------------------------------------------------------------------
    def begin(self, xid: str, timeout_s: Optional[float] = None, coordinator: str = "") -> Transaction:
        """``timeout_s`` limits both the open and the prepared (in-doubt) life of the transaction; at most
        ``max_timeout_s`` (the broker's transactionMaxTimeout)."""
        check_xid(xid)
        if timeout_s and timeout_s > self.max_timeout_s:
            raise TransactionError(f"transaction {xid!r}: a timeout of {timeout_s * 1000:.0f} ms exceeds the broker's "
                                   f"transactionMaxTimeout ({self.max_timeout_s * 1000:.0f} ms); ask for less (the "
                                   f"sink's transactionTimeoutMs) or raise transactionMaxTimeout on the brokers")
        with self._lock:
            if xid in self._live or self._outcome(xid) is not None:
                raise TransactionError(f"transaction {xid!r} already exists")
            t = self._live[xid] = Transaction(xid, "open", timeout_s or self.default_timeout_s, coordinator,
                                              started=self._clock())
            return t

    def put(self, xid: str, topic: str, partition: int, body: records.EncodedBody) -> Transaction:
        """Journal a checked batch body for the transaction (not fsynced until prepare)."""
        self.store.partition(topic, partition).check_size(body)  # unknown partition, oversize: fail now
        with self._lock:
            t = self._open(xid)
            meta = json.dumps({"xid": xid, "topic": topic, "partition": partition, "count": body.count,
                               "attributes": body.attributes, "crc": body.crc}).encode()
            pos = self._write(PUT, [struct.pack("<I", len(meta)), meta] + list(body.parts))
            t.puts.append(_Put(topic, partition, body.count, body.attributes, body.crc,
                               pos + RECORD.size + 4 + len(meta), body.size))
            return t

    def prepare(self, xid: str) -> Transaction:
        with self._lock:
            t = self._live.get(xid)
            if t is not None and t.state == "prepared":
                return t
            t = self._open(xid)
            t.state, t.prepared_at = "prepared", time.time()
            self._write(PREPARE, [self._prepare_record(t)], fsync=True)
            return t

    def commit(self, xid: str) -> str:
        """Make the transaction's messages visible; returns "committed". Repeating it is a success."""
        with self._lock:
            if self._outcome(xid) == "committed":
                return "committed"
            t = self._live.get(xid)
            if t is None or t.state == "open":
                raise self._not_prepared(xid, t)
            if t.state == "prepared":
                t.state, t.number = "committing", self._next_number
                self._next_number += 1
                t.before = {f"{p.topic}/{p.partition}": self.store.partition(p.topic, p.partition).latest_offset
                            for p in t.puts}
                self._write(COMMIT, [json.dumps({"xid": xid, "number": t.number, "before": t.before}).encode()],
                            fsync=True)
            self._apply(t)
            self._finish(t, "committed", DONE)
            return "committed"

    def rollback(self, xid: str) -> str:
        with self._lock:
            done = self._outcome(xid)
            if done is None and xid not in self._live:
                if self._forgot_commits:  # it may be one of the forgotten commits: do not claim otherwise
                    raise UnknownTransactionError(
                        f"transaction {xid!r} is unknown: its outcome may have been forgotten (this broker keeps "
                        f"{KEEP_FINISHED} outcomes of transactions without a decision record), or it was never "
                        f"begun or lost with a restart before it was prepared")
                return "rolled_back"  # never seen (e.g. lost with a crash before prepare): nothing to undo
            if done == "rolled_back":
                return "rolled_back"
            if done == "committed" or self._live[xid].state == "committing":
                raise TransactionError(f"transaction {xid!r} is committed; it cannot be rolled back")
            self._finish(self._live[xid], "rolled_back", ROLLBACK)
            return "rolled_back"

    def state(self, xid: str) -> Optional[str]:
        with self._lock:
            t = self._live.get(xid)
            return t.state if t is not None else self._outcome(xid)

    def get(self, xid: str) -> Optional[Transaction]:
        return self._live.get(xid)

    def prepared(self) -> list:
        """XA recover: prepared transactions whose outcome is pending."""
        with self._lock:
            return [t for t in self._live.values() if t.state == "prepared"]

    def counts(self) -> dict:
        with self._lock:
            out = {"open": 0, "prepared": 0, "committing": 0}
            for t in self._live.values():
                out[t.state] += 1
            return out

    def decided_records(self) -> set:
        """The decision records named by remembered outcomes (the resolver checks which still exist)."""
        with self._lock:
            return {path for _, path in self._decided.values()}

    def forget_decided(self, gone: set) -> int:
        """Forget the outcomes whose decision record is gone (no replay can ask for them any more);
        journalled by the next compaction. Returns how many were forgotten."""
        with self._lock:
            drop = [xid for xid, (_, path) in self._decided.items() if path in gone]
            for xid in drop:
                del self._decided[xid]
            return len(drop)

    def expire(self) -> list:
        """Roll back open transactions older than their timeout (prepared ones never: their outcome
        may still be commit). Returns the xids rolled back."""
        now = self._clock()
        with self._lock:
            late = [t for t in self._live.values() if t.state == "open" and now - t.started > t.timeout_s]
            for t in late:
                log.warning("transaction %s not prepared within %.0fs: rolled back", t.xid, t.timeout_s)
                self._finish(t, "rolled_back", ROLLBACK)
            return [t.xid for t in late]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None

    # -- internals ------------------------------------------------------------------------------------
    def _open(self, xid: str) -> Transaction:
        t = self._live.get(xid)
        if t is None or t.state != "open":
            raise self._not_prepared(xid, t) if t is None else TransactionError(
                f"transaction {xid!r} is {t.state}; it takes no more messages")
        return t

    def _not_prepared(self, xid: str, t: Optional[Transaction]) -> TransactionError:
        done = self._outcome(xid)
        if done is not None:
            return TransactionError(f"transaction {xid!r} is {done.replace('_', ' ')}")
        if t is not None:
            return TransactionError(f"transaction {xid!r} is {t.state}; prepare it first")
        return UnknownTransactionError(f"unknown transaction {xid!r} (never begun, timed out, or lost with a "
                                       f"broker restart before it was prepared)")

    def _finish(self, t: Transaction, outcome: str, record: int) -> None:
        path = _record_path(t.coordinator)
        self._write(record, [json.dumps({"xid": t.xid, "path": path}).encode()], fsync=t.state != "open")
        del self._live[t.xid]
        self._remember(t.xid, outcome, path)
        if self._size > COMPACT_BYTES and self._live_bytes() * 2 < self._size:
            self._compact()

    def _outcome(self, xid: str) -> Optional[str]:
        kept = self._decided.get(xid)
        return kept[0] if kept is not None else self._finished.get(xid)

    def _remember(self, xid: str, outcome: str, path: str = "") -> None:
        if path:
            self._decided[xid] = [outcome, path]
            return
        self._finished[xid] = outcome
        self._finished.move_to_end(xid)
        while len(self._finished) > KEEP_FINISHED:
            self._forgot_commits |= self._finished.popitem(last=False)[1] == "committed"

    def _prepare_record(self, t: Transaction) -> bytes:
        return json.dumps({"xid": t.xid, "coordinator": t.coordinator, "at": t.prepared_at,
                           "timeout": t.timeout_s}).encode()

    def _apply(self, t: Transaction, recovering: bool = False) -> None:
        """Append the transaction's messages, one atomic append per partition, in put order."""
        by_partition: dict = {}
        for p in t.puts:
            by_partition.setdefault((p.topic, p.partition), []).append(p)
        for (topic, partition), puts in sorted(by_partition.items()):
            if (topic, partition) in t.applied:  # a commit retried after a failure part-way
                continue
            part = self.store.partition(topic, partition)
            if recovering:  # the commit may have reached this partition before the crash
                puts = puts[part.count_txn_batches(t.before[f"{topic}/{partition}"], t.number):]
            if puts:
                part.append_bodies([self._body(p) for p in puts], txn=t.number)
            t.applied.add((topic, partition))

    def _body(self, p: _Put) -> records.EncodedBody:
        data = os.pread(self._fd, p.size, p.position)
        return records.parse_body(p.count, p.attributes, data, p.crc)

    @property
    def _fd(self) -> int:
        return self._file.fileno()

    def _write(self, kind: int, parts: list, fsync: bool = False) -> int:
        payload_len = sum(len(x) for x in parts)
        value = records.crc(bytes([kind]))
        for x in parts:
            value = records.crc(x, value)
        pos = self._size
        self._file.write(RECORD.pack(payload_len, value, kind))
        for x in parts:
            self._file.write(x)
        self._file.flush()
        if fsync:
            os.fsync(self._fd)
        self._size += RECORD.size + payload_len
        return pos

    def _live_bytes(self) -> int:
        return sum(p.size + 512 for t in self._live.values() for p in t.puts)

    # -- recovery and compaction ----------------------------------------------------------------------
    def _recover(self) -> None:
        self._file = None
        data = self.path.read_bytes() if self.path.exists() else b""
        pos, end = 0, len(data)
        puts: dict = {}
        while pos < end:
            bad = self._bad_record(data, pos)
            if bad:
                if self._valid_record_after(data, pos):
                    raise CorruptLogError(f"{self.path}: damaged transaction record ({bad}) followed by valid "
                                          f"ones", self.path, pos)
                log.warning("%s: cutting a torn tail of %d bytes at %d (%s)", self.path, end - pos, pos, bad)
                with open(self.path, "r+b") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())
                end = pos
                break
            length, _, kind = RECORD.unpack_from(data, pos)
            payload = data[pos + RECORD.size: pos + RECORD.size + length]
            self._replay(kind, payload, pos, puts)
            pos += RECORD.size + length
        self._file = open(self.path, "a+b")
        self._size = end
        # Open transactions die with the broker: their clients learn it at prepare.
        for xid in [x for x, t in self._live.items() if t.state == "open"]:
            del self._live[xid]
        for t in [t for t in self._live.values() if t.state == "committing"]:
            log.info("finishing the commit of transaction %s", t.xid)
            self._apply(t, recovering=True)
            self._finish(t, "committed", DONE)
        self._compact()

    @staticmethod
    def _bad_record(data: bytes, pos: int) -> str:
        if len(data) - pos < RECORD.size:
            return "truncated header"
        length, value, kind = RECORD.unpack_from(data, pos)
        if pos + RECORD.size + length > len(data):
            return "truncated payload"
        if records.crc(data[pos + RECORD.size: pos + RECORD.size + length], records.crc(bytes([kind]))) != value:
            return "checksum mismatch"
        if not PUT <= kind <= FINISHED:
            return f"unknown type {kind}"
        return ""

    def _valid_record_after(self, data: bytes, pos: int) -> bool:
        return any(not self._bad_record(data, p) and RECORD.unpack_from(data, p)[0] > 0
                   for p in range(pos + 1, len(data) - RECORD.size))

    def _replay(self, kind: int, payload: bytes, pos: int, puts: dict) -> None:
        if kind == PUT:
            n = struct.unpack_from("<I", payload)[0]
            m = json.loads(payload[4: 4 + n])
            t = self._live.setdefault(m["xid"], Transaction(m["xid"], "open", self.default_timeout_s))
            t.puts.append(_Put(m["topic"], m["partition"], m["count"], m["attributes"], m["crc"],
                               pos + RECORD.size + 4 + n, len(payload) - 4 - n))
            return
        m = json.loads(payload)
        if kind == FINISHED:
            for xid, outcome in m["finished"]:
                self._remember(xid, outcome)
            for xid, outcome, path in m.get("decided", []):
                self._remember(xid, outcome, path)
            self._forgot_commits |= m.get("forgot_commits", False)
            self._next_number = max(self._next_number, m["next_number"])
            return
        t = self._live.get(m["xid"])
        if kind == PREPARE:
            t = t or self._live.setdefault(m["xid"], Transaction(m["xid"], "open", self.default_timeout_s))
            t.state, t.coordinator, t.prepared_at = "prepared", m["coordinator"], m["at"]
            t.timeout_s = m.get("timeout", self.default_timeout_s)
        elif kind == COMMIT and t is not None:
            t.state, t.number, t.before = "committing", m["number"], m["before"]
            self._next_number = max(self._next_number, t.number + 1)
        elif kind in (DONE, ROLLBACK):
            self._live.pop(m["xid"], None)
            self._remember(m["xid"], "committed" if kind == DONE else "rolled_back", m.get("path", ""))

    def _compact(self) -> None:
        """Rewrite the journal with what is still needed: the remembered outcomes and the prepared
        transactions' records (tmp file, fsync, rename: a crash leaves the old or the new journal)."""
        tmp = self.path.with_suffix(".tmp")
        old = self._file
        self._file, self._size = open(tmp, "wb"), 0
        try:
            self._write(FINISHED, [json.dumps({"finished": list(self._finished.items()),
                                               "decided": [[x, o, p] for x, (o, p) in self._decided.items()],
                                               "forgot_commits": self._forgot_commits,
                                               "next_number": self._next_number}).encode()])
            for t in self._live.values():
                moved = []
                for p in t.puts:
                    data = os.pread(old.fileno(), p.size, p.position)
                    meta = json.dumps({"xid": t.xid, "topic": p.topic, "partition": p.partition, "count": p.count,
                                       "attributes": p.attributes, "crc": p.crc}).encode()
                    pos = self._write(PUT, [struct.pack("<I", len(meta)), meta, data])
                    moved.append(_Put(p.topic, p.partition, p.count, p.attributes, p.crc,
                                      pos + RECORD.size + 4 + len(meta), p.size))
                t.puts = moved
                if t.state == "prepared":
                    self._write(PREPARE, [self._prepare_record(t)])
            self._file.flush()
            os.fsync(self._fd)
        except BaseException:
            self._file.close()
            self._file = old
            raise
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        old.close()
        self._file.close()
        self._file = open(self.path, "a+b")
