"""What a broker transaction is (Kafka's TransactionMetadata): its states, the one table of the transitions
between them, and the outcomes a broker remembers of finished ones.

    open ──prepare──▶ prepared ──commit──▶ committing ──markers──▶ committed
      │                  │
      └────rollback──────┴──────────────▶ aborting ───markers──▶ rolled_back

``committing`` and ``aborting`` are *settling*: the decision is journalled, markers may still be missing.
``committed`` and ``rolled_back`` are outcomes: the transaction leaves the live set and is remembered
(``Outcomes``). A transaction that recovery or a promotion finds settling or prepared starts there.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from metaq_broker.errors import TransactionError

MAX_XID_BYTES = 255
KEEP_FINISHED = 100_000  # coordinator-less outcomes remembered so that a repeated commit/rollback succeeds


class TxnState(str, Enum):
    """A transaction's state; equal to its name as a string (the gRPC replies and the journal carry that)."""

    OPEN = "open"
    PREPARED = "prepared"
    COMMITTING = "committing"
    ABORTING = "aborting"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"

    def __str__(self) -> str:
        return self.value

    @property
    def words(self) -> str:
        """For messages: "rolled back"."""
        return self.value.replace("_", " ")


OPEN, PREPARED, COMMITTING, ABORTING, COMMITTED, ROLLED_BACK = TxnState
SETTLING = frozenset({COMMITTING, ABORTING})

# The only moves a transaction makes (``Transaction.move``).
TRANSITIONS = {
    OPEN: {PREPARED, ABORTING},
    PREPARED: {COMMITTING, ABORTING},
    COMMITTING: {COMMITTED},
    ABORTING: {ROLLED_BACK},
    COMMITTED: set(),
    ROLLED_BACK: set(),
}


def check_xid(xid: str) -> str:
    if not isinstance(xid, str) or not xid or len(xid.encode()) > MAX_XID_BYTES:
        raise TransactionError(f"a transaction id must be 1 to {MAX_XID_BYTES} bytes, got {xid!r}")
    return xid


@dataclass
class Transaction:
    xid: str
    state: TxnState
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
        return self.state in SETTLING

    def move(self, to: TxnState) -> None:
        """Go to state ``to``; a move ``TRANSITIONS`` does not list raises, naming both states."""
        if to not in TRANSITIONS[self.state]:
            raise TransactionError(f"transaction {self.xid!r}: no transition from {self.state} to {to}")
        self.state = to


class Outcomes:
    """The outcomes of finished transactions, so that a commit or rollback sent again gets the same answer.
    Those of transactions begun with a decision record are kept while the record exists (a replay of the
    record asks for them; ``forget``), the others for the last ``KEEP_FINISHED`` (LRU). The numbers of
    recently committed transactions are kept too: a replica promoted before their markers arrived (its
    snapshot said "committed") commits the batches it has, never aborts them."""

    def __init__(self):
        self.finished: OrderedDict = OrderedDict()  # xid -> COMMITTED | ROLLED_BACK (LRU)
        self.decided: dict = {}  # xid -> [outcome, decision record path]
        self.forgot_commits = False  # a committed outcome left the LRU: an unknown xid may be committed
        self.committed_numbers: OrderedDict = OrderedDict()  # number -> None (LRU)

    def get(self, xid: str):
        kept = self.decided.get(xid)
        return kept[0] if kept is not None else self.finished.get(xid)

    def remember(self, xid: str, outcome, path: str = "", number: int = 0) -> None:
        outcome = TxnState(outcome)
        if number and outcome is COMMITTED:
            self.note_committed(number)
        if path:
            self.decided[xid] = [outcome, path]
            return
        self.finished[xid] = outcome
        self.finished.move_to_end(xid)
        while len(self.finished) > KEEP_FINISHED:
            self.forgot_commits |= self.finished.popitem(last=False)[1] is COMMITTED

    def note_committed(self, number: int) -> None:
        self.committed_numbers[number] = None
        self.committed_numbers.move_to_end(number)
        while len(self.committed_numbers) > KEEP_FINISHED:
            self.committed_numbers.popitem(last=False)

    def records(self) -> set:
        """The decision records named by remembered outcomes."""
        return {path for _, path in self.decided.values()}

    def forget(self, gone: set) -> int:
        """Forget the outcomes whose decision record is in ``gone``; returns how many."""
        drop = [xid for xid, (_, path) in self.decided.items() if path in gone]
        for xid in drop:
            del self.decided[xid]
        return len(drop)

    def image(self) -> dict:
        """The FINISHED record's payload (without its seq and ``next_number``)."""
        return {"finished": list(self.finished.items()),
                "decided": [[x, o, p] for x, (o, p) in self.decided.items()],
                "forgot_commits": self.forgot_commits, "committed_numbers": list(self.committed_numbers)}

    def load(self, m: dict) -> None:
        """Take in a FINISHED record's payload."""
        for xid, outcome in m["finished"]:
            self.remember(xid, outcome)
        for xid, outcome, path in m["decided"]:
            self.remember(xid, outcome, path)
        self.forgot_commits |= m["forgot_commits"]
        for number in m.get("committed_numbers", ()):
            self.note_committed(number)
