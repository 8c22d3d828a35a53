"""Broker transactions over the message store: MetaQ's local/XA transactions, written into the log.

A transaction's batches are appended to their partitions as they arrive, flagged with the transaction's
number (Kafka's design): readers stop at the partition's last stable offset and never see them unsettled.
``prepare`` makes them durable (an fsync of each partition touched) and then journals, fsynced, which
partitions hold them. ``commit`` journals the decision (fsynced), then appends a commit marker to each
partition; ``rollback`` an abort marker, after which readers skip the batches. Nothing is copied at commit.
A settlement cut short (a crash, a full disk) is finished by recovery, or by ``expire`` every second, from
the journal and the partitions' own record of which transactions still lack a marker: all or nothing,
across partitions, whatever fails. Commit and rollback are idempotent.

The journal holds small JSON records only: ``u32 payload length | u32 CRC-32C of (type, payload) | u8 type |
payload``. A torn tail is cut; damage followed by valid records refuses to open; a failed write is cut back
so the journal stays as it was. docs/transactions.md gives the layout; ``journal_v1`` opens journals of the
metaq that kept transactions out of the log.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from metaq_broker.errors import CorruptLogError, TransactionError, UnknownTransactionError
from metaq_broker.protocol import records
from metaq_broker.store import journal_v1
from metaq_broker.store.durable import append_or_cut_back, fsync_dir, make_dirs, replace_file
from metaq_broker.store.journal_frames import RECORD, bad_record, frame, valid_record_after

log = logging.getLogger(__name__)

JOURNAL = "transactions.log"
PREPARE, COMMIT, ROLLBACK, DONE, FINISHED = 1, 2, 3, 4, 5
KINDS = range(PREPARE, FINISHED + 1)
MAX_XID_BYTES = 255
KEEP_FINISHED = 100_000  # coordinator-less outcomes remembered so that a repeated commit/rollback succeeds
COMPACT_BYTES = 16 << 20
MAX_NUMBER = (1 << 32) - 1  # numbers are u32 in batch headers


@dataclass
class Transaction:
    xid: str
    state: str  # open | prepared | committing | aborting, then committed | rolled_back once settled
    timeout_s: float
    number: int
    coordinator: str = ""
    started: float = field(default_factory=time.monotonic)
    prepared_at: float = 0.0  # wall-clock seconds
    partitions: dict = field(default_factory=dict)  # (topic, partition) -> offset after its last batch there
    messages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # puts and settling, in order

    @property
    def settling(self) -> bool:
        return self.state in ("committing", "aborting")


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
        self.directory = Path(directory)
        self.path = self.directory / JOURNAL
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._live: dict = {}  # xid -> Transaction
        self._finished: OrderedDict = OrderedDict()  # xid -> "committed" | "rolled_back" (LRU, KEEP_FINISHED)
        # Outcomes of transactions begun with a decision record: kept while the record exists (a replay of
        # the record asks for them), xid -> [outcome, record path]; ``forget_decided`` drops them.
        self._decided: dict = {}
        self._forgot_commits = False  # a committed outcome left the LRU: an unknown xid may be committed
        self._next_number = 1
        self._fd = -1
        self._size = 0
        make_dirs(self.directory)
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
            number = self._next_number
            self._next_number = number % MAX_NUMBER + 1
            t = self._live[xid] = Transaction(xid, "open", timeout_s or self.default_timeout_s, number, coordinator,
                                              started=self._clock())
            return t

    def put(self, xid: str, topic: str, partition: int, body: records.EncodedBody):
        """Append a checked batch body to the partition as the transaction's (written, not yet fsynced:
        ``prepare`` does that). Returns the AppendResult."""
        part = self.store.partition(topic, partition)
        part.check_size(body)  # unknown partition, oversize: fail now
        t = self._get_open(xid)
        with t.lock:
            if t.state != "open":
                raise self._not_open(xid, t)
            result = part.append_bodies([body], t.number, records.TRANSACTIONAL)[0]
            t.partitions[(topic, partition)] = result.base_offset + result.count
            t.messages += result.count
            return result

    def prepare(self, xid: str) -> Transaction:
        """Make the transaction's batches durable, then journal (fsynced) where they are: it survives a
        crash from here on, and only its decision settles it."""
        t = self._live.get(xid)
        if t is not None and t.state == "prepared":
            return t
        t = self._get_open(xid)
        with t.lock:
            if t.state == "prepared":
                return t
            if t.state != "open":
                raise self._not_open(xid, t)
            for (topic, partition), end in sorted(t.partitions.items()):
                self.store.partition(topic, partition).make_durable(end)
            prepared_at = time.time()
            with self._lock:
                self._write(PREPARE, self._prepare_record(t, prepared_at), fsync=True)
                t.state, t.prepared_at = "prepared", prepared_at
            return t

    def commit(self, xid: str) -> str:
        """Make the transaction's messages visible; returns "committed". Repeating it is a success."""
        with self._lock:
            if self._outcome(xid) == "committed":
                return "committed"
            t = self._live.get(xid)
            if t is None or t.state in ("open", "aborting"):
                raise self._not_prepared(xid, t)
        with t.lock:
            if t.state == "prepared":
                with self._lock:
                    self._write(COMMIT, {"xid": xid, "number": t.number}, fsync=True)
                    t.state = "committing"
            if t.state == "committing":
                self._settle(t)
            elif t.state != "committed":  # rolled back meanwhile
                raise TransactionError(f"transaction {xid!r} is {t.state.replace('_', ' ')}")
        return "committed"

    def rollback(self, xid: str) -> str:
        with self._lock:
            done = self._outcome(xid)
            t = self._live.get(xid)
            if done is None and t is None:
                if self._forgot_commits:  # it may be one of the forgotten commits: do not claim otherwise
                    raise UnknownTransactionError(
                        f"transaction {xid!r} is unknown: its outcome may have been forgotten (this broker keeps "
                        f"{KEEP_FINISHED} outcomes of transactions without a decision record), or it was never "
                        f"begun or lost with a restart before it was prepared")
                return "rolled_back"  # never seen (e.g. lost with a crash before prepare): nothing to undo
            if done == "rolled_back":
                return "rolled_back"
            if done == "committed" or t.state == "committing":
                raise TransactionError(f"transaction {xid!r} is committed; it cannot be rolled back")
        with t.lock:
            if t.state in ("open", "prepared"):
                with self._lock:
                    # A prepared transaction's rollback must survive a crash; an open one is rolled back by
                    # recovery anyway (the journal does not know it), so its record need not be fsynced.
                    self._write(ROLLBACK, {"xid": xid, "number": t.number}, fsync=t.state == "prepared")
                    t.state = "aborting"
            if t.state == "aborting":
                self._settle(t)
            elif t.state != "rolled_back":  # committed meanwhile
                raise TransactionError(f"transaction {xid!r} is committed; it cannot be rolled back")
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

    def open_transactions(self) -> list:
        with self._lock:
            return [t for t in self._live.values() if t.state == "open"]

    def counts(self) -> dict:
        with self._lock:
            out = {"open": 0, "prepared": 0, "committing": 0, "aborting": 0}
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
        """Roll back open transactions older than their timeout (prepared ones never: their outcome may
        still be commit), and finish settlements cut short (a marker append that failed, e.g. on a full
        disk). Returns the xids rolled back."""
        now = self._clock()
        with self._lock:
            late = [t for t in self._live.values() if t.state == "open" and now - t.started > t.timeout_s]
            unfinished = [t for t in self._live.values() if t.settling]
        for t in late:
            log.warning("transaction %s not prepared within %.0fs: rolled back", t.xid, t.timeout_s)
            self.rollback(t.xid)
        for t in unfinished:
            with t.lock:
                try:
                    self._settle(t)
                except Exception as e:  # noqa: BLE001 - e.g. a full disk: tried again next time
                    log.warning("could not finish settling transaction %s yet (%s); retrying", t.xid, e)
        return [t.xid for t in late]

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1

    # -- internals ------------------------------------------------------------------------------------
    def _get_open(self, xid: str) -> Transaction:
        with self._lock:
            t = self._live.get(xid)
            if t is None or t.state != "open":
                raise self._not_open(xid, t)
            return t

    def _not_open(self, xid: str, t: Optional[Transaction]) -> TransactionError:
        if t is None:
            return self._not_prepared(xid, None)
        return TransactionError(f"transaction {xid!r} is {t.state}; it takes no more messages")

    def _not_prepared(self, xid: str, t: Optional[Transaction]) -> TransactionError:
        done = self._outcome(xid)
        if done is not None:
            return TransactionError(f"transaction {xid!r} is {done.replace('_', ' ')}")
        if t is not None:
            return TransactionError(f"transaction {xid!r} is {t.state}; prepare it first")
        return UnknownTransactionError(f"unknown transaction {xid!r} (never begun, timed out, or lost with a "
                                       f"broker restart before it was prepared)")

    def _settle(self, t: Transaction) -> None:
        """Append the decided marker to every partition still waiting for it (holding ``t.lock``), then
        forget the transaction. A failure leaves it settling; ``expire`` tries again."""
        if not t.settling:  # settled meanwhile by another caller
            return
        commit = t.state == "committing"
        for (topic, partition) in sorted(t.partitions):
            part = self.store.partition(topic, partition)
            if t.number in part.txns.ongoing:
                part.append_marker(t.number, commit)
        outcome = "committed" if commit else "rolled_back"
        path = _record_path(t.coordinator)
        with self._lock:
            self._write(DONE, {"xid": t.xid, "number": t.number, "outcome": outcome, "path": path})
            del self._live[t.xid]
            t.state = outcome
            self._remember(t.xid, outcome, path)
            if self._size > COMPACT_BYTES:
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

    @staticmethod
    def _prepare_record(t: Transaction, prepared_at: float) -> dict:
        return {"xid": t.xid, "number": t.number, "coordinator": t.coordinator, "at": prepared_at,
                "timeout": t.timeout_s, "messages": t.messages,
                "partitions": [[topic, p, end] for (topic, p), end in sorted(t.partitions.items())]}

    def _write(self, kind: int, payload: dict, fsync: bool = False) -> None:
        """Append one record (holding ``_lock``). If the write or its fsync fails, the journal is cut back
        to where it was and the error raised: the file stays valid and the broker keeps serving."""
        record = frame(kind, json.dumps(payload).encode())
        append_or_cut_back(self._fd, self.path, [record], self._size, fsync)
        self._size += len(record)

    # -- recovery and compaction ----------------------------------------------------------------------
    def _recover(self) -> None:
        legacy = self.directory / journal_v1.JOURNAL
        if legacy.exists() and not self.path.exists():
            self._migrate(legacy)
        elif legacy.exists():  # a migration finished before a crash removed the old journal
            legacy.unlink()
            fsync_dir(self.directory)
        data = self.path.read_bytes() if self.path.exists() else b""
        pos, end = 0, len(data)
        while pos < end:
            bad = bad_record(data, pos, KINDS)
            if bad:
                if valid_record_after(data, pos, KINDS):
                    raise CorruptLogError(f"{self.path}: damaged transaction record ({bad}) followed by valid "
                                          f"ones", self.path, pos)
                log.warning("%s: cutting a torn tail of %d bytes at %d (%s)", self.path, end - pos, pos, bad)
                end = pos
                break
            length, _, kind = RECORD.unpack_from(data, pos)
            self._replay(kind, json.loads(data[pos + RECORD.size: pos + RECORD.size + length]))
            pos += RECORD.size + length
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if end < len(data):
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        self._size = end
        self._reconcile()
        self._compact()

    def _reconcile(self) -> None:
        """Bring the partitions in line with the journal: a transaction the journal does not know as
        prepared or decided (it was open at the crash) is aborted; decided ones get their markers."""
        by_number = {t.number: t for t in self._live.values()}
        highest = 0
        for topic in self.store.topics():
            for part in self.store.partitions(topic):
                highest = max(highest, part.txns.max_txn)
                for number in sorted(part.txns.ongoing):
                    t = by_number.get(number)
                    if t is None:  # open at a crash: the journal never heard of it
                        t = by_number[number] = self._live[f"(never prepared #{number})"] = Transaction(
                            f"(never prepared #{number})", "aborting", self.default_timeout_s, number)
                        log.info("%s: transaction %d was never prepared (open at a crash): rolling it back",
                                 part.name, number)
                    t.partitions.setdefault((topic, part.partition), part.log_end_offset)
        self._next_number = max(self._next_number, highest % MAX_NUMBER + 1)
        for t in [t for t in self._live.values() if t.settling]:
            try:
                self._settle(t)
            except Exception as e:  # noqa: BLE001 - e.g. a full disk: expire() retries every second
                log.warning("could not finish settling transaction %s yet (%s); retrying", t.xid, e)

    def _replay(self, kind: int, m: dict) -> None:
        if kind == FINISHED:
            for xid, outcome in m["finished"]:
                self._remember(xid, outcome)
            for xid, outcome, path in m["decided"]:
                self._remember(xid, outcome, path)
            self._forgot_commits |= m["forgot_commits"]
            self._next_number = max(self._next_number, m["next_number"])
            return
        xid = m["xid"]
        self._next_number = max(self._next_number, m["number"] % MAX_NUMBER + 1)
        if kind == PREPARE:
            t = self._live[xid] = Transaction(xid, "prepared", m["timeout"], m["number"], m["coordinator"],
                                              prepared_at=m["at"], messages=m["messages"])
            t.partitions = {(topic, p): end for topic, p, end in m["partitions"]}
        elif kind in (COMMIT, ROLLBACK) and xid in self._live:
            self._live[xid].state = "committing" if kind == COMMIT else "aborting"
        elif kind == DONE:
            self._live.pop(xid, None)
            self._remember(xid, m["outcome"], m["path"])

    def _compact(self) -> None:
        """Rewrite the journal with what is still needed: the remembered outcomes and the records of the
        transactions still prepared or settling (tmp file, fsync, rename: a crash leaves one or the other)."""
        out = [(FINISHED, {"finished": list(self._finished.items()),
                           "decided": [[x, o, p] for x, (o, p) in self._decided.items()],
                           "forgot_commits": self._forgot_commits, "next_number": self._next_number})]
        for t in self._live.values():
            if t.state == "open":
                continue
            out.append((PREPARE, self._prepare_record(t, t.prepared_at)))
            if t.settling:
                out.append((COMMIT if t.state == "committing" else ROLLBACK, {"xid": t.xid, "number": t.number}))
        blob = b"".join(frame(k, json.dumps(m).encode()) for k, m in out)
        replace_file(self.path, blob)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR, 0o644)
        self._size = len(blob)

    def _migrate(self, legacy: Path) -> None:
        """Open a journal of the metaq that kept transactions out of the log: finish its cut-short commits
        the old way, append its prepared transactions' batches to their partitions under new numbers, and
        write this journal. Until the new journal is in place the old one stays, so a crash repeats it
        (batches appended by an interrupted run are never prepared here, so recovery aborts them)."""
        old = journal_v1.read(legacy)
        self._next_number = max(self._next_number, old.next_number,
                                *(p.txns.max_txn % MAX_NUMBER + 1 for tp in self.store.topics()
                                  for p in self.store.partitions(tp)))
        for t in old.committing:
            journal_v1.finish_commit(self.store, old, t)
            self._remember(t.xid, "committed", _record_path(t.coordinator))
        for xid, outcome, path in old.outcomes:
            self._remember(xid, outcome, path)
        self._forgot_commits |= old.forgot_commits
        for t in old.prepared:
            new = Transaction(t.xid, "prepared", t.timeout_s, self._next_number, t.coordinator,
                              prepared_at=t.prepared_at)
            self._next_number += 1
            for put in t.puts:
                part = self.store.partition(put.topic, put.partition)
                r = part.append_bodies([old.body(put)], new.number, records.TRANSACTIONAL)[0]
                new.partitions[(put.topic, put.partition)] = r.base_offset + r.count
                new.messages += r.count
            for (topic, partition), end in new.partitions.items():
                self.store.partition(topic, partition).make_durable(end)
            self._live[t.xid] = new
        old.close()
        self._compact()
        self._live.clear()  # replayed from the new journal next
        legacy.unlink()
        fsync_dir(self.directory)
        log.info("converted %s (%d prepared, %d cut-short commits) to %s", legacy, len(old.prepared),
                 len(old.committing), self.path)
