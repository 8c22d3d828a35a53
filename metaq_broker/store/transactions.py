"""Broker transactions over the message store: MetaQ's local/XA transactions, written into the log. This
module is the state machine (Kafka's TransactionStateManager and coordinator): the XA calls, settling,
recovery, promotion; ``txn_state.py`` says what a transaction is and which moves it may make,
``txn_journal.py`` keeps the journal file, ``txn_follower.py`` applies a master's journal on a replica.

A transaction's batches are appended to their partitions as they arrive, flagged with the transaction's
number (Kafka's design): readers stop at the partition's last stable offset and never see them unsettled.
``prepare`` makes them durable (an fsync of each partition touched) and then journals, fsynced, which
partitions hold them. ``commit`` journals the decision (fsynced), then appends a commit marker to each
partition; ``rollback`` an abort marker, after which readers skip the batches. Nothing is copied at commit.
A settlement cut short (a crash, a full disk) is finished by recovery, or by ``expire`` every second, from
the journal and the partitions' own record of which transactions still lack a marker: all or nothing,
across partitions, whatever fails. Commit and rollback are idempotent. ``journal_v1`` opens journals of
the metaq that kept transactions out of the log.

Replication: the master serves its recent records (``records_since``) or a compacted image
(``snapshot_records``); a replica's manager, in follower mode, applies them behind its data gates
(``apply``), refuses client calls, and on ``promote`` settles what the journal says, as recovery.

Lock order: a transaction's ``lock`` (its puts and its settling, in order), then the manager's ``_lock``
(the live transactions, the outcomes, the journal and the follower), then a partition's locks (taken
inside ``PartitionLog`` calls: appends, markers, fsyncs). Never the other way: no partition calls back
into this manager, and no code holding ``_lock`` takes a transaction's ``lock``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Optional

from metaq_broker.errors import InvalidPartitionError, TransactionError, UnknownTopicError, UnknownTransactionError
from metaq_broker.protocol import records
from metaq_broker.store import journal_v1
from metaq_broker.store.durable import fsync_dir, make_dirs
from metaq_broker.store.txn_follower import JournalFollower
from metaq_broker.store.txn_journal import (COMMIT, COMPACT_BYTES, DONE, FINISHED, PREPARE, ROLLBACK,
                                            TransactionJournal, encode)
from metaq_broker.store.txn_state import (ABORTING, COMMITTED, COMMITTING, KEEP_FINISHED, OPEN, PREPARED,
                                          ROLLED_BACK, Outcomes, Transaction, TxnState, check_xid)

log = logging.getLogger(__name__)

MAX_NUMBER = (1 << 32) - 1  # numbers are u32 in batch headers
# A promoted member's first record comes this far past its last one: a replica that applied records of the
# old master this member never got asks from a seq it does not hold, and gets a snapshot, not a stream
# whose seqs mean other records (there are never this many unacknowledged records).
PROMOTION_SEQ_GAP = 1 << 32


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
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._live: dict = {}  # xid -> Transaction not settled yet
        self._outcomes = Outcomes()
        self._next_number = 1
        self._image_cache: Optional[tuple] = None  # (seq, snapshot_records() at that seq)
        make_dirs(self.directory)
        self.journal = TransactionJournal(self.directory, getattr(store, "notify_written", None))
        self._follower: Optional[JournalFollower] = self._new_follower() if follower else None
        self._recover()

    @property
    def path(self) -> Path:
        """The journal file."""
        return self.journal.path

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
            if xid in self._live or self._outcomes.get(xid) is not None:
                raise TransactionError(f"transaction {xid!r} already exists")
            number = self._next_number
            self._next_number = number % MAX_NUMBER + 1
            t = self._live[xid] = Transaction(xid, OPEN, timeout_s or self.default_timeout_s, number, coordinator,
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
            if t.state is not OPEN:
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
        if t is not None and t.state is PREPARED:
            return t
        t = self._get_open(xid)
        with t.lock:
            if t.state is PREPARED:
                return t
            if t.state is not OPEN:
                raise self._not_open(xid, t)
            for (topic, partition), end in sorted(t.partitions.items()):
                self.store.partition(topic, partition).make_durable(end)
            prepared_at = time.time()
            with self._lock:
                seq = self.journal.append(PREPARE, self._prepare_record(t, prepared_at), fsync=True)
                t.move(PREPARED)
                t.prepared_at, t.seq = prepared_at, seq
            return t

    def commit(self, xid: str) -> str:
        """Make the transaction's messages visible; returns "committed". Repeating it is a success."""
        self._refuse_if_follower(xid)
        with self._lock:
            if self._outcomes.get(xid) is COMMITTED:
                return COMMITTED
            t = self._live.get(xid)
            if t is None or t.state in (OPEN, ABORTING):
                raise self._not_prepared(xid, t)
        with t.lock:
            if t.state is PREPARED:
                self._decide(t, COMMITTING, fsync=True)
            if t.state is COMMITTING:
                self._settle(t)
            elif t.state is not COMMITTED:  # rolled back meanwhile
                raise TransactionError(f"transaction {xid!r} is {t.state.words}")
        return COMMITTED

    def rollback(self, xid: str) -> str:
        self._refuse_if_follower(xid)
        with self._lock:
            done = self._outcomes.get(xid)
            t = self._live.get(xid)
            if done is None and t is None:
                if self._outcomes.forgot_commits:  # it may be one of the forgotten commits: do not claim otherwise
                    raise UnknownTransactionError(
                        f"transaction {xid!r} is unknown: its outcome may have been forgotten (this broker keeps "
                        f"{KEEP_FINISHED} outcomes of transactions without a decision record), or it was never "
                        f"begun or lost with a restart before it was prepared")
                return ROLLED_BACK  # never seen (e.g. lost with a crash before prepare): nothing to undo
            if done is ROLLED_BACK:
                return ROLLED_BACK
            if done is COMMITTED or t.state is COMMITTING:
                raise TransactionError(f"transaction {xid!r} is committed; it cannot be rolled back")
        with t.lock:
            if t.state in (OPEN, PREPARED):
                # A prepared transaction's rollback must survive a crash; an open one is rolled back by
                # recovery anyway (the journal does not know it), so its record need not be fsynced.
                self._decide(t, ABORTING, fsync=t.state is PREPARED)
            if t.state is ABORTING:
                self._settle(t)
            elif t.state is not ROLLED_BACK:  # committed meanwhile
                raise TransactionError(f"transaction {xid!r} is committed; it cannot be rolled back")
        return ROLLED_BACK

    def state(self, xid: str) -> Optional[TxnState]:
        with self._lock:
            t = self._live.get(xid)
            return t.state if t is not None else self._outcomes.get(xid)

    def get(self, xid: str) -> Optional[Transaction]:
        return self._live.get(xid)

    def prepared(self) -> list:
        """XA recover: prepared transactions whose outcome is pending."""
        with self._lock:
            return [t for t in self._live.values() if t.state is PREPARED]

    def open_transactions(self) -> list:
        with self._lock:
            return [t for t in self._live.values() if t.state is OPEN]

    def on_topic(self, topic: str) -> list:
        """The xids of live transactions (open, prepared, settling) with a batch in ``topic``."""
        with self._lock:
            return sorted(t.xid for t in self._live.values() if any(key[0] == topic for key in t.partitions))

    def counts(self) -> dict:
        with self._lock:
            out = {str(s): 0 for s in (OPEN, PREPARED, COMMITTING, ABORTING)}
            for t in self._live.values():
                out[t.state] += 1
            return out

    def decided_records(self) -> set:
        """The decision records named by remembered outcomes (the resolver checks which still exist)."""
        with self._lock:
            return self._outcomes.records()

    def forget_decided(self, gone: set) -> int:
        """Forget the outcomes whose decision record is gone (no replay can ask for them any more);
        journalled by the next compaction. Returns how many were forgotten."""
        with self._lock:
            self._image_cache = None
            return self._outcomes.forget(gone)

    def expire(self) -> list:
        """Roll back open transactions older than their timeout (prepared ones never: their outcome may
        still be commit), and finish settlements cut short (a marker append that failed, e.g. on a full
        disk). Returns the xids rolled back. A follower does nothing: the master decides."""
        if self._follower is not None:
            return []
        now = self._clock()
        with self._lock:
            late = [t for t in self._live.values() if t.state is OPEN and now - t.started > t.timeout_s]
            unfinished = [t for t in self._live.values() if t.settling]
        for t in late:
            log.warning("transaction %s not prepared within %.0fs: rolled back", t.xid, t.timeout_s)
            self.rollback(t.xid)
        for t in unfinished:
            with t.lock:
                self._try_settle(t, "tried again next time")
        return [t.xid for t in late]

    def close(self) -> None:
        with self._lock:
            self.journal.close()

    # -- replication ----------------------------------------------------------------------------------
    @property
    def journal_seq(self) -> int:
        """The seq of the last record written (or applied, on a follower); 0 for none."""
        return self.journal.seq

    @property
    def applied_seq(self) -> int:
        """The position to fetch the master's records from: ``journal_seq``, or -1 while this follower
        needs a snapshot (after ``follow()`` or a start as a replica, until one is applied whole)."""
        follower = self._follower
        return self.journal.seq if follower is None else follower.applied_seq

    @property
    def follower(self) -> bool:
        return self._follower is not None

    def records_since(self, seq: int, max_bytes: int = 1 << 20) -> Optional[tuple]:
        """(first_seq, last_seq, frames) of the records after ``seq`` held in memory (at least one, then up
        to ``max_bytes``); (seq + 1, seq, b"") when there are none; None when ``seq`` is -1, older than the
        memory tail or ahead of this journal: send ``snapshot_records()`` instead."""
        with self._lock:
            return self.journal.records_since(seq, max_bytes)

    def snapshot_records(self) -> tuple:
        """(first_seq, last_seq, frames): the compacted journal (FINISHED, then the PREPARE and COMMIT or
        ROLLBACK of every transaction prepared or settling, each with its seq; last_seq = journal_seq).
        Applied to an empty follower it gives this manager's prepared, settling and remembered state."""
        with self._lock:
            if self._image_cache is None or self._image_cache[0] != self.journal.seq:
                self._image_cache = (self.journal.seq, self._image())
            return self._image_cache[1]

    def follow(self) -> None:
        """Become a follower: drop open transactions from memory without markers (their batches are in the
        log; the next master's reconcile aborts them), refuse client calls, stop ``expire``. The next
        stream must begin with a snapshot (``applied_seq`` is -1 until one is applied)."""
        with self._lock:
            for xid in [x for x, t in self._live.items() if t.state is OPEN]:
                del self._live[xid]
            self._follower = self._new_follower()
            self._image_cache = None

    def promote(self) -> None:
        """Leave follower mode: drop records not applied, then settle from the journal as recovery does
        (prepared stays prepared, decided ones get their markers, ones unknown to the journal are
        aborted at once: an open transaction is not journalled, so this member cannot continue it, and its
        first batch would hold readers back). Seqs go on ``PROMOTION_SEQ_GAP`` past the last applied one,
        so every replica starts from a snapshot of this member's journal."""
        with self._lock:
            if self._follower is None:
                return
            self._follower = self._image_cache = None
            self.journal.restart(self.journal.seq + PROMOTION_SEQ_GAP)
            self._reconcile()

    def apply(self, frames: bytes, first_seq: int, last_seq: int, snapshot: bool) -> int:
        """Take the master's records (``records_since`` or ``snapshot_records`` output) and apply what the
        data gates allow (``apply_pending``); returns ``applied_seq``. Records already held are ignored; a
        gap raises ValueError. A snapshot replaces journal and state whole, once all its PREPAREs' data is
        durable here."""
        with self._lock:
            if self._follower is None:
                raise TransactionError("this broker is the master: it writes its own transaction journal")
            self._follower.receive(frames, first_seq, last_seq, snapshot)
            return self.apply_pending()

    def apply_pending(self) -> int:
        """Apply the held records whose data gate is now met, in order, stopping at the first that is not
        (call it after making replicated data durable); fsyncs the journal once. Returns ``applied_seq``."""
        with self._lock:
            if self._follower is None:
                return self.journal.seq
            seq = self._follower.apply_ready()
            self._compact_if_due()
            return seq

    def _new_follower(self) -> JournalFollower:
        return JournalFollower(self.journal, self.store, self._replay, self._reset, self.get)

    def _reset(self) -> None:
        """Forget all state: a follower's snapshot replaces it."""
        self._live, self._outcomes, self._next_number, self._image_cache = {}, Outcomes(), 1, None

    # -- internals ------------------------------------------------------------------------------------
    def _refuse_if_follower(self, xid) -> None:
        if self._follower is not None:
            raise TransactionError(f"this broker is a replica: it takes no transaction calls (transaction "
                                   f"{xid!r}); the group's master does")

    def _get_open(self, xid: str) -> Transaction:
        with self._lock:
            t = self._live.get(xid)
            if t is None or t.state is not OPEN:
                raise self._not_open(xid, t)
            return t

    def _not_open(self, xid: str, t: Optional[Transaction]) -> TransactionError:
        if t is None:
            return self._not_prepared(xid, None)
        return TransactionError(f"transaction {xid!r} is {t.state}; it takes no more messages")

    def _not_prepared(self, xid: str, t: Optional[Transaction]) -> TransactionError:
        done = self._outcomes.get(xid)
        if done is not None:
            return TransactionError(f"transaction {xid!r} is {done.words}")
        if t is not None:
            return TransactionError(f"transaction {xid!r} is {t.state}; prepare it first")
        return UnknownTransactionError(f"unknown transaction {xid!r} (never begun, timed out, or lost with a "
                                       f"broker restart before it was prepared)")

    def _decide(self, t: Transaction, to: TxnState, fsync: bool) -> None:
        """Journal ``t``'s decision (COMMIT for COMMITTING, ROLLBACK for ABORTING), then move it there."""
        with self._lock:
            kind = COMMIT if to is COMMITTING else ROLLBACK
            seq = self.journal.append(kind, {"xid": t.xid, "number": t.number}, fsync=fsync)
            t.move(to)
            t.decision_seq = seq

    def _settle(self, t: Transaction) -> None:
        """Append the decided marker to every partition still waiting for it (holding ``t.lock``), then
        forget the transaction. A failure leaves it settling; ``expire`` tries again."""
        if not t.settling:  # settled meanwhile by another caller
            return
        commit = t.state is COMMITTING
        topics = set(self.store.topics())
        for (topic, partition) in sorted(t.partitions):
            if topic not in topics:
                continue  # deleted (a put raced the deletion): no log is left to mark
            part = self.store.partition(topic, partition)
            if t.number in part.txns.ongoing:
                part.append_marker(t.number, commit)
        outcome = COMMITTED if commit else ROLLED_BACK
        path = _record_path(t.coordinator)
        with self._lock:
            self.journal.append(DONE, {"xid": t.xid, "number": t.number, "outcome": outcome, "path": path})
            del self._live[t.xid]
            t.move(outcome)
            self._outcomes.remember(t.xid, outcome, path, t.number)
            self._compact_if_due()

    def _try_settle(self, t: Transaction, then: str) -> None:
        try:
            self._settle(t)
        except Exception as e:  # noqa: BLE001 - e.g. a full disk
            log.warning("could not finish settling transaction %s yet (%s); %s", t.xid, e, then)

    @staticmethod
    def _prepare_record(t: Transaction, prepared_at: float) -> dict:
        return {"xid": t.xid, "number": t.number, "coordinator": t.coordinator, "at": prepared_at,
                "timeout": t.timeout_s, "messages": t.messages,
                "partitions": [[topic, p, end] for (topic, p), end in sorted(t.partitions.items())]}

    # -- recovery and compaction ----------------------------------------------------------------------
    def _recover(self) -> None:
        legacy = self.directory / journal_v1.JOURNAL
        if legacy.exists() and not self.path.exists():
            self._migrate(legacy)
        elif legacy.exists():  # a migration finished before a crash removed the old journal
            legacy.unlink()
            fsync_dir(self.directory)
        for kind, m in self.journal.recover():
            self._replay(kind, m)
        if self._follower is None:  # a replica writes no markers: its log is the master's copy
            self._reconcile()
        self._compact()

    def _reconcile(self) -> None:
        """Bring the partitions in line with the journal: a transaction the journal does not know as
        prepared or decided (it was open at the crash) is aborted; decided ones get their markers."""
        for t in [t for t in self._live.values() if t.state is PREPARED]:
            outcome = self._outcome_in_log(t)
            if outcome is not None:  # a replica got a marker before the decision record: the log decides
                log.info("transaction %s is prepared in the journal but %s in the log here: finishing that",
                         t.xid, "committed" if outcome is COMMITTING else "rolled back")
                self._decide(t, outcome, fsync=True)
        by_number = {t.number: t for t in self._live.values()}
        highest = 0
        for part in self.store.all_partitions():
            highest = max(highest, part.txns.max_txn)
            for number in sorted(part.txns.ongoing):
                t = by_number.get(number)
                if t is None and number in self._outcomes.committed_numbers:  # a replica without its markers yet
                    t = by_number[number] = self._live[f"(committed #{number})"] = Transaction(
                        f"(committed #{number})", COMMITTING, self.default_timeout_s, number)
                    log.info("%s: transaction %d is committed but lacks its marker here: committing it",
                             part.name, number)
                elif t is None:  # open at a crash: the journal never heard of it
                    t = by_number[number] = self._live[f"(never prepared #{number})"] = Transaction(
                        f"(never prepared #{number})", ABORTING, self.default_timeout_s, number)
                    log.info("%s: transaction %d was never prepared (open at a crash): rolling it back",
                             part.name, number)
                t.partitions.setdefault((part.topic, part.partition), part.visible_end)
        self._next_number = max(self._next_number, highest % MAX_NUMBER + 1)
        for t in [t for t in self._live.values() if t.settling]:
            self._try_settle(t, "retrying every second")

    def _outcome_in_log(self, t: Transaction) -> Optional[TxnState]:
        """COMMITTING or ABORTING when a partition of prepared ``t`` already holds its marker (a replica
        copies the log and the journal in separate parts of a reply, so a marker may come before its
        decision record), else None. A PREPARE is applied only once its batches are durable here, so a
        number no longer unsettled in a partition that still holds its last batch was settled by a marker."""
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
                    return COMMITTING if commit else ABORTING
            aborted = txns.aborted_in(0, end)
            return ABORTING if (aborted["txn"] == t.number).any() else COMMITTING
        return None

    def _replay(self, kind: int, m: dict) -> None:
        """Apply one journal record to the state (recovery, and a follower's records)."""
        if kind == FINISHED:
            self._outcomes.load(m)
            self._next_number = max(self._next_number, m["next_number"])
            return
        xid = m["xid"]
        self._next_number = max(self._next_number, m["number"] % MAX_NUMBER + 1)
        if kind == PREPARE:
            t = self._live[xid] = Transaction(xid, PREPARED, m["timeout"], m["number"], m["coordinator"],
                                              prepared_at=m["at"], messages=m["messages"])
            t.partitions = {(topic, p): end for topic, p, end in m["partitions"]}
            t.seq = m["seq"]
        elif kind in (COMMIT, ROLLBACK) and xid in self._live:
            t = self._live[xid]
            t.move(COMMITTING if kind == COMMIT else ABORTING)
            t.decision_seq = m["seq"]
        elif kind == DONE:
            self._live.pop(xid, None)
            self._outcomes.remember(xid, m["outcome"], m["path"], m["number"])

    def _image(self) -> tuple:
        """(first_seq, last_seq, frames) of what is still needed: the remembered outcomes (FINISHED, seq =
        the last one it covers) and the records of the transactions still prepared or settling, each with
        its own seq (one without, e.g. converted from an old journal, takes the last)."""
        last = self.journal.seq
        out = [(FINISHED, {**self._outcomes.image(), "next_number": self._next_number, "seq": last})]
        for t in self._live.values():
            if t.state is OPEN:
                continue
            out.append((PREPARE, {**self._prepare_record(t, t.prepared_at), "seq": t.seq or last}))
            if t.settling:
                out.append((COMMIT if t.state is COMMITTING else ROLLBACK,
                            {"xid": t.xid, "number": t.number, "seq": t.decision_seq or last}))
        return min(m["seq"] for _, m in out), last, encode(out)

    def _compact(self) -> None:
        """Rewrite the journal with ``_image()``; seqs are kept."""
        self.journal.rewrite(self._image()[2])

    def _compact_if_due(self) -> None:
        if self.journal.size > COMPACT_BYTES:
            self._compact()

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
            self._outcomes.remember(t.xid, COMMITTED, _record_path(t.coordinator))
        for xid, outcome, path in old.outcomes:
            self._outcomes.remember(xid, outcome, path)
        self._outcomes.forgot_commits |= old.forgot_commits
        for t in old.prepared:
            new = Transaction(t.xid, PREPARED, t.timeout_s, self._next_number, t.coordinator,
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
