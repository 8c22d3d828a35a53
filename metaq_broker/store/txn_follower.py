"""A replica's side of the transaction journal (docs/design/replication-plan.md, section 8): the master's
records arrive as a stream (``TransactionManager.records_since``) or a compacted image
(``snapshot_records``); they are appended byte for byte, and replayed, only once this member's log holds
their data. The gates: a PREPARE once its batches are durable here, a DONE once its markers are written
here. A record waits, and every record after it, until its gate is met; a snapshot waits whole until the
batches of all its PREPAREs are durable, then replaces journal and state.

Locking: none of its own. ``TransactionManager`` calls it holding its ``_lock`` (the lock order is written
in ``transactions.py``); the gates read partitions' ends and unsettled numbers, which take no lock.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from metaq_broker.errors import InvalidPartitionError, UnknownTopicError
from metaq_broker.store.txn_journal import DONE, PREPARE, TransactionJournal, parse


class JournalFollower:
    """Records received from the master and not applied yet. ``replay(kind, payload)`` applies one record
    to the state, ``reset()`` empties the state before a snapshot, ``get(xid)`` finds a live transaction."""

    def __init__(self, journal: TransactionJournal, store, replay: Callable, reset: Callable, get: Callable):
        self.journal, self.store = journal, store
        self._replay, self._reset, self._get = replay, reset, get
        self.pending: deque = deque()  # (seq, kind, payload dict, frame), in order
        self._snapshot: Optional[tuple] = None  # (last_seq, frames, [(seq, kind, payload, frame)])
        self._need_snapshot = True  # until one is applied: this journal may be of another lineage

    @property
    def applied_seq(self) -> int:
        """The position to fetch the master's records from; -1 while a snapshot is needed."""
        return -1 if self._need_snapshot else self.journal.seq

    def receive(self, frames: bytes, first_seq: int, last_seq: int, snapshot: bool) -> None:
        """Hold the master's records. Records already held are ignored; a gap raises ValueError. A
        snapshot replaces what is held, unless it is the one held or already applied."""
        if snapshot:
            held = self._snapshot
            same = (last_seq == held[0] if held is not None
                    else not self._need_snapshot and not self.pending and last_seq == self.journal.seq)
            if not same:
                self._snapshot = (last_seq, bytes(frames), parse(frames))
                self.pending.clear()
        elif frames:
            recs = parse(frames)
            if [r[0] for r in recs] != list(range(first_seq, first_seq + len(recs))):
                raise ValueError(f"journal stream: records are not numbered {first_seq} on")
            have = self._received()
            recs = [r for r in recs if r[0] > have]
            if recs and have < 0:
                raise ValueError(f"journal stream: a snapshot is expected first, got records from seq {first_seq}")
            if recs and recs[0][0] != have + 1:
                raise ValueError(f"journal stream: gap, records from seq {recs[0][0]} after seq {have}")
            self.pending.extend(recs)

    def apply_ready(self) -> int:
        """Apply the held snapshot and records whose gate is now met, in order, stopping at the first that
        is not; fsyncs the journal once. Returns ``applied_seq``."""
        if self._snapshot is not None:
            last, blob, recs = self._snapshot
            if not all(self._gate(kind, m) for _, kind, m, _ in recs if kind == PREPARE):
                return self.applied_seq
            self.journal.rewrite(blob, last)
            self._reset()
            for _, kind, m, _ in recs:
                self._replay(kind, m)
            self._need_snapshot, self._snapshot = False, None
        wrote = False
        try:
            while self.pending:
                seq, kind, m, record = self.pending[0]
                if not self._gate(kind, m):
                    break
                self.journal.copy(record, seq)
                wrote = True
                self.pending.popleft()
                self._replay(kind, m)
        finally:
            if wrote:
                self.journal.sync()
        return self.applied_seq

    def _received(self) -> int:
        """The seq of the last record held, applied or pending (-1: a snapshot is needed first)."""
        if self.pending:
            return self.pending[-1][0]
        if self._snapshot is not None:
            return self._snapshot[0]
        return self.applied_seq

    def _gate(self, kind: int, m: dict) -> bool:
        """A PREPARE only once its batches are durable here; a DONE only once its markers are written here."""
        if kind == PREPARE:
            for topic, p, end in m["partitions"]:
                try:
                    part = self.store.partition(topic, p)
                except (UnknownTopicError, InvalidPartitionError):  # not created here yet
                    return False
                if part.recovery_point < end:
                    return False
        elif kind == DONE:
            t = self._get(m["xid"])
            parts = ([self.store.partition(topic, p) for topic, p in t.partitions] if t is not None
                     else self.store.all_partitions())
            return not any(m["number"] in part.txns.ongoing for part in parts)
        return True
