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

Replication: every record carries a ``seq`` (+1 per record). The master serves the recent records from
memory (``records_since``) or a compacted image (``snapshot_records``); a replica's manager, in follower
mode, appends them byte for byte (``apply``) once its log holds their data (a PREPARE's batches durable, a
DONE's markers written), refuses client calls, and on ``promote`` settles what the journal says, as recovery.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from metaq_broker.errors import (CorruptLogError, InvalidPartitionError, TransactionError, UnknownTopicError,
                                 UnknownTransactionError)
from metaq_broker.protocol import records
from metaq_broker.store import journal_v1
from metaq_broker.store.durable import append_or_cut_back, fsync_dir, make_dirs, replace_file
from metaq_broker.store.journal_frames import RECORD, bad_record, frame, split, valid_record_after

log = logging.getLogger(__name__)

JOURNAL = "transactions.log"
PREPARE, COMMIT, ROLLBACK, DONE, FINISHED = 1, 2, 3, 4, 5
KINDS = range(PREPARE, FINISHED + 1)
MAX_XID_BYTES = 255
KEEP_FINISHED = 100_000  # coordinator-less outcomes remembered so that a repeated commit/rollback succeeds
COMPACT_BYTES = 16 << 20
MAX_NUMBER = (1 << 32) - 1  # numbers are u32 in batch headers
TAIL_BYTES = 8 << 20  # recent records kept in memory for replicas; one further behind gets a snapshot
# A promoted member's first record comes this far past its last one: a replica that applied records of the
# old master this member never got asks from a seq it does not hold, and gets a snapshot, not a stream
# whose seqs mean other records (there are never this many unacknowledged records).
PROMOTION_SEQ_GAP = 1 << 32


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
    seq: int = 0  # of its PREPARE record (kept by compaction)
    decision_seq: int = 0  # of its COMMIT or ROLLBACK record

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
                 max_timeout_s: float = 900.0, follower: bool = False):
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
        # Numbers of recently committed transactions (KEEP_FINISHED): a replica promoted before their commit
        # markers arrived (its snapshot said "committed") commits the batches it has, never aborts them.
        self._committed_numbers: OrderedDict = OrderedDict()
        self._next_number = 1
        self._fd = -1
        self._size = 0
        self._seq = 0  # of the last record written or applied
        self._tail: list = []  # frames of the last records (seq _tail_first on), at most about TAIL_BYTES
        self._tail_first, self._tail_bytes = 1, 0
        self._image_cache: Optional[tuple] = None  # (seq, snapshot_records() at that seq)
        # Follower mode: records received but not applied yet (their data gate is not met), in order; a
        # snapshot waiting whole for its PREPAREs' data; whether the next stream must start with a snapshot.
        self._follower = follower
        self._pending: deque = deque()  # (seq, kind, payload dict, frame)
        self._pending_snapshot: Optional[tuple] = None  # (last_seq, frames, [(seq, kind, payload, frame)])
        self._need_snapshot = follower  # a restarted replica's journal may be of another lineage
        make_dirs(self.directory)
        self._recover()

    # -- API ------------------------------------------------------------------------------------------
    def begin(self, xid: str, timeout_s: Optional[float] = None, coordinator: str = "") -> Transaction:
        """``timeout_s`` limits both the open and the prepared (in-doubt) life of the transaction; at most
        ``max_timeout_s`` (the broker's transactionMaxTimeout)."""
        self._refuse_if_follower(xid)
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
        self._refuse_if_follower(xid)
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
        self._refuse_if_follower(xid)
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
                t.state, t.prepared_at, t.seq = "prepared", prepared_at, self._seq
            return t

    def commit(self, xid: str) -> str:
        """Make the transaction's messages visible; returns "committed". Repeating it is a success."""
        self._refuse_if_follower(xid)
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
                    t.state, t.decision_seq = "committing", self._seq
            if t.state == "committing":
                self._settle(t)
            elif t.state != "committed":  # rolled back meanwhile
                raise TransactionError(f"transaction {xid!r} is {t.state.replace('_', ' ')}")
        return "committed"

    def rollback(self, xid: str) -> str:
        self._refuse_if_follower(xid)
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
                    t.state, t.decision_seq = "aborting", self._seq
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
            self._image_cache = None
            return len(drop)

    def expire(self) -> list:
        """Roll back open transactions older than their timeout (prepared ones never: their outcome may
        still be commit), and finish settlements cut short (a marker append that failed, e.g. on a full
        disk). Returns the xids rolled back. A follower does nothing: the master decides."""
        if self._follower:
            return []
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

    # -- replication ----------------------------------------------------------------------------------
    @property
    def journal_seq(self) -> int:
        """The seq of the last record written (or applied, on a follower); 0 for none."""
        return self._seq

    @property
    def applied_seq(self) -> int:
        """The position to fetch the master's records from: ``journal_seq``, or -1 while this follower
        needs a snapshot (after ``follow()`` or a start as a replica, until one is applied whole)."""
        return -1 if self._follower and self._need_snapshot else self._seq

    @property
    def follower(self) -> bool:
        return self._follower

    def records_since(self, seq: int, max_bytes: int = 1 << 20) -> Optional[tuple]:
        """(first_seq, last_seq, frames) of the records after ``seq`` held in memory (at least one, then up
        to ``max_bytes``); (seq + 1, seq, b"") when there are none; None when ``seq`` is -1, older than the
        memory tail or ahead of this journal: send ``snapshot_records()`` instead."""
        with self._lock:
            if seq == self._seq and seq >= 0:
                return seq + 1, seq, b""
            if seq < 0 or seq > self._seq or seq + 1 < self._tail_first:
                return None
            i = seq + 1 - self._tail_first
            out, size = [], 0
            for f in self._tail[i:]:
                if out and size + len(f) > max_bytes:
                    break
                out.append(f)
                size += len(f)
            return seq + 1, seq + len(out), b"".join(out)

    def snapshot_records(self) -> tuple:
        """(first_seq, last_seq, frames): the compacted journal (FINISHED, then the PREPARE and COMMIT or
        ROLLBACK of every transaction prepared or settling, each with its seq; last_seq = journal_seq).
        Applied to an empty follower it gives this manager's prepared, settling and remembered state."""
        with self._lock:
            if self._image_cache is None or self._image_cache[0] != self._seq:
                self._image_cache = (self._seq, self._image())
            return self._image_cache[1]

    def follow(self) -> None:
        """Become a follower: drop open transactions from memory without markers (their batches are in the
        log; the next master's reconcile aborts them), refuse client calls, stop ``expire``. The next
        stream must begin with a snapshot (``applied_seq`` is -1 until one is applied)."""
        with self._lock:
            for xid in [x for x, t in self._live.items() if t.state == "open"]:
                del self._live[xid]
            self._follower = self._need_snapshot = True
            self._pending.clear()
            self._pending_snapshot = self._image_cache = None

    def promote(self) -> None:
        """Leave follower mode: drop records not applied, then settle from the journal as recovery does
        (prepared stays prepared, decided ones get their markers, ones unknown to the journal are
        aborted at once: an open transaction is not journalled, so this member cannot continue it, and its
        first batch would hold readers back). Seqs go on ``PROMOTION_SEQ_GAP`` past the last applied one,
        so every replica starts from a snapshot of this member's journal."""
        with self._lock:
            if not self._follower:
                return
            self._pending.clear()
            self._pending_snapshot = self._image_cache = None
            self._follower = self._need_snapshot = False
            self._seq += PROMOTION_SEQ_GAP
            self._tail, self._tail_first, self._tail_bytes = [], self._seq + 1, 0
            self._reconcile()

    def apply(self, frames: bytes, first_seq: int, last_seq: int, snapshot: bool) -> int:
        """Take the master's records (``records_since`` or ``snapshot_records`` output) and apply what the
        data gates allow (``apply_pending``); returns ``applied_seq``. Records already held are ignored; a
        gap raises ValueError. A snapshot replaces journal and state whole, once all its PREPAREs' data is
        durable here."""
        with self._lock:
            if not self._follower:
                raise TransactionError("this broker is the master: it writes its own transaction journal")
            if snapshot:
                held = self._pending_snapshot
                same = (last_seq == held[0] if held is not None
                        else not self._need_snapshot and not self._pending and last_seq == self._seq)
                if not same:
                    self._pending_snapshot = (last_seq, bytes(frames), self._parse(frames))
                    self._pending.clear()
            elif frames:
                recs = self._parse(frames)
                if [r[0] for r in recs] != list(range(first_seq, first_seq + len(recs))):
                    raise ValueError(f"journal stream: records are not numbered {first_seq} on")
                have = self._received()
                recs = [r for r in recs if r[0] > have]
                if recs and have < 0:
                    raise ValueError(f"journal stream: a snapshot is expected first, got records from seq "
                                     f"{first_seq}")
                if recs and recs[0][0] != have + 1:
                    raise ValueError(f"journal stream: gap, records from seq {recs[0][0]} after seq {have}")
                self._pending.extend(recs)
            return self.apply_pending()

    def apply_pending(self) -> int:
        """Apply the held records whose data gate is now met, in order, stopping at the first that is not
        (call it after making replicated data durable); fsyncs the journal once. Returns ``applied_seq``."""
        with self._lock:
            if not self._follower:
                return self.applied_seq
            if self._pending_snapshot is not None:
                last, blob, recs = self._pending_snapshot
                if not all(self._gate(kind, m) for _, kind, m, _ in recs if kind == PREPARE):
                    return self.applied_seq
                self._install_snapshot(last, blob, recs)
            wrote = False
            try:
                while self._pending:
                    _, kind, m, record = self._pending[0]
                    if not self._gate(kind, m):
                        break
                    append_or_cut_back(self._fd, self.path, [record], self._size)
                    self._size += len(record)
                    wrote = True
                    self._pending.popleft()
                    self._replay(kind, m)
                    self._tail_add(record)
            finally:
                if wrote:
                    os.fsync(self._fd)
            if self._size > COMPACT_BYTES:
                self._compact()
            return self.applied_seq

    def _received(self) -> int:
        """The seq of the last record held, applied or pending (-1: a snapshot is needed first)."""
        if self._pending:
            return self._pending[-1][0]
        if self._pending_snapshot is not None:
            return self._pending_snapshot[0]
        return -1 if self._need_snapshot else self._seq

    @staticmethod
    def _parse(frames: bytes) -> list:
        out = []
        for kind, payload, record in split(frames, KINDS):
            m = json.loads(payload)
            out.append((m["seq"], kind, m, record))
        return out

    def _gate(self, kind: int, m: dict) -> bool:
        """A PREPARE only once its batches are durable here; a DONE only once its markers are written here."""
        if kind == PREPARE:
            for topic, p, end in m["partitions"]:
                try:
                    part = self.store.partition(topic, p)
                except (UnknownTopicError, InvalidPartitionError):  # not created here yet
                    return False
                if part.durable_offset < end:
                    return False
        elif kind == DONE:
            t = self._live.get(m["xid"])
            parts = ([self.store.partition(topic, p) for topic, p in t.partitions] if t is not None
                     else self.store.all_partitions())
            return not any(m["number"] in part.txns.ongoing for part in parts)
        return True

    def _install_snapshot(self, last: int, blob: bytes, recs: list) -> None:
        replace_file(self.path, blob)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR, 0o600)
        self._size = len(blob)
        self._live, self._finished, self._decided = {}, OrderedDict(), {}
        self._committed_numbers = OrderedDict()
        self._forgot_commits, self._next_number = False, 1
        for _, kind, m, _ in recs:
            self._replay(kind, m)
        self._seq = last
        self._tail, self._tail_first, self._tail_bytes = [], last + 1, 0
        self._need_snapshot, self._pending_snapshot, self._image_cache = False, None, None

    def _tail_add(self, record: bytes) -> None:
        self._tail.append(record)
        self._tail_bytes += len(record)
        if self._tail_bytes > TAIL_BYTES:  # drop a quarter at once: amortised
            n, drop = 0, 0
            while self._tail_bytes - drop > TAIL_BYTES * 3 // 4:
                drop += len(self._tail[n])
                n += 1
            del self._tail[:n]
            self._tail_first += n
            self._tail_bytes -= drop

    # -- internals ------------------------------------------------------------------------------------
    def _refuse_if_follower(self, xid) -> None:
        if self._follower:
            raise TransactionError(f"this broker is a replica: it takes no transaction calls (transaction "
                                   f"{xid!r}); the group's master does")

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
            self._remember(t.xid, outcome, path, t.number)
            if self._size > COMPACT_BYTES:
                self._compact()

    def _outcome(self, xid: str) -> Optional[str]:
        kept = self._decided.get(xid)
        return kept[0] if kept is not None else self._finished.get(xid)

    def _remember(self, xid: str, outcome: str, path: str = "", number: int = 0) -> None:
        if number and outcome == "committed":
            self._note_committed(number)
        if path:
            self._decided[xid] = [outcome, path]
            return
        self._finished[xid] = outcome
        self._finished.move_to_end(xid)
        while len(self._finished) > KEEP_FINISHED:
            self._forgot_commits |= self._finished.popitem(last=False)[1] == "committed"

    def _note_committed(self, number: int) -> None:
        self._committed_numbers[number] = None
        self._committed_numbers.move_to_end(number)
        while len(self._committed_numbers) > KEEP_FINISHED:
            self._committed_numbers.popitem(last=False)

    @staticmethod
    def _prepare_record(t: Transaction, prepared_at: float) -> dict:
        return {"xid": t.xid, "number": t.number, "coordinator": t.coordinator, "at": prepared_at,
                "timeout": t.timeout_s, "messages": t.messages,
                "partitions": [[topic, p, end] for (topic, p), end in sorted(t.partitions.items())]}

    def _write(self, kind: int, payload: dict, fsync: bool = False) -> None:
        """Append one record with the next seq (holding ``_lock``). If the write or its fsync fails, the
        journal is cut back to where it was and the error raised: the file stays valid and the broker keeps
        serving. Wakes replica fetches waiting for news."""
        payload["seq"] = self._seq + 1
        record = frame(kind, json.dumps(payload).encode())
        append_or_cut_back(self._fd, self.path, [record], self._size, fsync)
        self._size += len(record)
        self._seq += 1
        self._tail_add(record)
        notify = getattr(self.store, "notify_written", None)
        if notify is not None:
            notify()

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
            m = json.loads(data[pos + RECORD.size: pos + RECORD.size + length])
            m.setdefault("seq", self._seq + 1)  # a journal of a metaq without seqs
            self._replay(kind, m)
            pos += RECORD.size + length
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if end < len(data):
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        self._size = end
        self._tail_first = self._seq + 1  # the tail holds what is written from here on
        if not self._follower:  # a replica writes no markers: its log is the master's copy
            self._reconcile()
        self._compact()

    def _reconcile(self) -> None:
        """Bring the partitions in line with the journal: a transaction the journal does not know as
        prepared or decided (it was open at the crash) is aborted; decided ones get their markers."""
        for t in [t for t in self._live.values() if t.state == "prepared"]:
            outcome = self._outcome_in_log(t)
            if outcome is not None:  # a replica got a marker before the decision record: the log decides
                log.info("transaction %s is prepared in the journal but %s in the log here: finishing that",
                         t.xid, "committed" if outcome == COMMIT else "rolled back")
                self._write(outcome, {"xid": t.xid, "number": t.number}, fsync=True)
                t.state, t.decision_seq = "committing" if outcome == COMMIT else "aborting", self._seq
        by_number = {t.number: t for t in self._live.values()}
        highest = 0
        for part in self.store.all_partitions():
            highest = max(highest, part.txns.max_txn)
            for number in sorted(part.txns.ongoing):
                t = by_number.get(number)
                if t is None and number in self._committed_numbers:  # a replica without its markers yet
                    t = by_number[number] = self._live[f"(committed #{number})"] = Transaction(
                        f"(committed #{number})", "committing", self.default_timeout_s, number)
                    log.info("%s: transaction %d is committed but lacks its marker here: committing it",
                             part.name, number)
                elif t is None:  # open at a crash: the journal never heard of it
                    t = by_number[number] = self._live[f"(never prepared #{number})"] = Transaction(
                        f"(never prepared #{number})", "aborting", self.default_timeout_s, number)
                    log.info("%s: transaction %d was never prepared (open at a crash): rolling it back",
                             part.name, number)
                t.partitions.setdefault((part.topic, part.partition), part.log_end_offset)
        self._next_number = max(self._next_number, highest % MAX_NUMBER + 1)
        for t in [t for t in self._live.values() if t.settling]:
            try:
                self._settle(t)
            except Exception as e:  # noqa: BLE001 - e.g. a full disk: expire() retries every second
                log.warning("could not finish settling transaction %s yet (%s); retrying", t.xid, e)

    def _outcome_in_log(self, t: Transaction) -> Optional[int]:
        """COMMIT or ROLLBACK when a partition of prepared ``t`` already holds its marker (a replica copies
        the log and the journal in separate parts of a reply, so a marker may come before its decision
        record), else None. A PREPARE is applied only once its batches are durable here, so a number no
        longer unsettled in a partition that still holds its last batch was settled by a marker."""
        for (topic, p), end in sorted(t.partitions.items()):
            try:
                part = self.store.partition(topic, p)
            except (UnknownTopicError, InvalidPartitionError):
                continue
            txns = part.txns
            if t.number in txns.ongoing or part.earliest_offset >= end:  # (gone with retention: no evidence)
                continue
            for _, number, _, commit in txns.settled:  # marker above the high watermark
                if number == t.number:
                    return COMMIT if commit else ROLLBACK
            aborted = txns.aborted_in(0, end)
            return ROLLBACK if (aborted["txn"] == t.number).any() else COMMIT
        return None

    def _replay(self, kind: int, m: dict) -> None:
        self._seq = max(self._seq, m["seq"])  # a compacted journal's FINISHED has the highest
        if kind == FINISHED:
            for xid, outcome in m["finished"]:
                self._remember(xid, outcome)
            for xid, outcome, path in m["decided"]:
                self._remember(xid, outcome, path)
            self._forgot_commits |= m["forgot_commits"]
            self._next_number = max(self._next_number, m["next_number"])
            for number in m.get("committed_numbers", ()):
                self._note_committed(number)
            return
        xid = m["xid"]
        self._next_number = max(self._next_number, m["number"] % MAX_NUMBER + 1)
        if kind == PREPARE:
            t = self._live[xid] = Transaction(xid, "prepared", m["timeout"], m["number"], m["coordinator"],
                                              prepared_at=m["at"], messages=m["messages"])
            t.partitions = {(topic, p): end for topic, p, end in m["partitions"]}
            t.seq = m["seq"]
        elif kind in (COMMIT, ROLLBACK) and xid in self._live:
            t = self._live[xid]
            t.state, t.decision_seq = "committing" if kind == COMMIT else "aborting", m["seq"]
        elif kind == DONE:
            self._live.pop(xid, None)
            self._remember(xid, m["outcome"], m["path"], m["number"])

    def _image(self) -> tuple:
        """(first_seq, last_seq, frames) of what is still needed: the remembered outcomes (FINISHED, seq =
        the last one it covers) and the records of the transactions still prepared or settling, each with
        its own seq (one without, e.g. converted from an old journal, takes the last)."""
        last = self._seq
        out = [(FINISHED, {"finished": list(self._finished.items()),
                           "decided": [[x, o, p] for x, (o, p) in self._decided.items()],
                           "forgot_commits": self._forgot_commits, "next_number": self._next_number,
                           "committed_numbers": list(self._committed_numbers), "seq": last})]
        for t in self._live.values():
            if t.state == "open":
                continue
            out.append((PREPARE, {**self._prepare_record(t, t.prepared_at), "seq": t.seq or last}))
            if t.settling:
                out.append((COMMIT if t.state == "committing" else ROLLBACK,
                            {"xid": t.xid, "number": t.number, "seq": t.decision_seq or last}))
        blob = b"".join(frame(k, json.dumps(m).encode()) for k, m in out)
        return min(m["seq"] for _, m in out), last, blob

    def _compact(self) -> None:
        """Rewrite the journal with ``_image()`` (tmp file, fsync, rename: a crash leaves one or the other).
        Seqs are kept, so the memory tail and replicas' positions stay valid."""
        blob = self._image()[2]
        replace_file(self.path, blob)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR, 0o600)
        self._size = len(blob)

    def _migrate(self, legacy: Path) -> None:
        """Open a journal of the metaq that kept transactions out of the log: finish its cut-short commits
        the old way, append its prepared transactions' batches to their partitions under new numbers, and
        write this journal. Until the new journal is in place the old one stays, so a crash repeats it
        (batches appended by an interrupted run are never prepared here, so recovery aborts them)."""
        old = journal_v1.read(legacy)
        self._next_number = max(self._next_number, old.next_number,
                                *(p.txns.max_txn % MAX_NUMBER + 1 for p in self.store.all_partitions()))
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
