"""What one partition knows of the transactions in its log (Kafka's producer state and aborted-transaction
index, in small): the unsettled ones, whose first offset holds readers back (the last stable offset), and
the aborted ones, whose batches readers skip.

Both are rebuilt on open from ``transactions.snapshot`` plus a scan of the batch headers written after
it; the snapshot is written when a segment rolls and when the partition closes, so the scan covers about
the active segment, which recovery reads anyway. A partition directory without a snapshot was written by
a metaq that kept transactions out of the log: it holds no transactional batch. docs/storage-format.md
gives the file's layout.

Under a high watermark (replication, ``advance``) a marker settles its transaction only once it lies below
the HW: until then the transaction stays unstable (``settled``), so readers never see an outcome the next
master might not have (Kafka's unreplicated transactions).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from metaq_broker.errors import CorruptLogError
from metaq_broker.protocol import records
from metaq_broker.store.durable import replace_file

SNAPSHOT = "transactions.snapshot"


class PartitionTxns:
    """Changed only under the partition's write lock; readers (no lock) use ``first_unstable()`` and
    ``aborted_in``, which read values replaced whole, never a dict being changed."""

    def __init__(self, hw: Optional[int] = None):
        self.ongoing: dict = {}  # transaction number -> offset of its first batch here; no marker yet
        self.settled: list = []  # (marker offset, number, first offset, commit): marker here, not below hw
        self.hw = hw  # None: no cap, a marker settles at once
        self._first: Optional[int] = None  # the least first offset of ongoing and settled
        self._aborted: list = []  # (number, first offset, marker offset), marker offsets increasing
        self._aborted_arr = records.NO_ABORTED
        self.max_txn = 0  # the highest transaction number seen in this log

    # -- state ----------------------------------------------------------------------------------------
    def first_unstable(self) -> Optional[int]:
        return self._first

    def on_batch(self, txn: int, offset: int) -> None:
        """A transactional batch of ``txn`` was appended at ``offset``."""
        if txn not in self.ongoing:
            self.ongoing[txn] = offset
            if self._first is None:
                self._first = offset
        self.max_txn = max(self.max_txn, txn)

    def on_marker(self, txn: int, offset: int, commit: bool) -> None:
        """``txn``'s marker was appended at ``offset``: the transaction is settled here, or, at or above
        the HW, kept unstable in ``settled`` until ``advance`` passes the marker."""
        self.max_txn = max(self.max_txn, txn)
        first = self.ongoing.pop(txn, None)  # _first still counts it until _release or settled has it
        if first is None:
            return
        if self.hw is not None and offset >= self.hw:
            self.settled.append((offset, txn, first, commit))
        else:
            self._release([(offset, txn, first, commit)])

    def advance(self, hw: Optional[int]) -> None:
        """The high watermark moved to ``hw`` (None: no cap): settle the transactions whose marker is now
        below it."""
        self.hw = hw
        k = len(self.settled) if hw is None else sum(1 for s in self.settled if s[0] < hw)
        if k:
            done, self.settled = self.settled[:k], self.settled[k:]
            self._release(done)

    def _release(self, done: list) -> None:
        aborts = [(txn, first, marker) for marker, txn, first, commit in done if not commit and first < marker]
        if aborts:  # listed before readers may pass their batches
            self._aborted = self._aborted + aborts
            self._aborted_arr = np.array(self._aborted, records.ABORTED_DTYPE)
        firsts = list(self.ongoing.values()) + [s[2] for s in self.settled]
        self._first = min(firsts) if firsts else None

    def aborted_in(self, start: int, end: int) -> np.ndarray:
        """Aborted transactions with batches in offsets [start, end)."""
        a = self._aborted_arr
        if not len(a):
            return a
        return a[(a["first"] < end) & (a["last"] > start)]

    def scan(self, u8: np.ndarray, positions: np.ndarray) -> None:
        """Take in the batches at ``positions`` of ``u8`` (in log order): one vectorised header read,
        then a step only per transactional batch or marker."""
        if not len(positions):
            return
        h = records.headers_at(u8, positions)
        flags = h["attributes"] & (records.TRANSACTIONAL | records.CONTROL)
        value_at = records.data_starts(u8, positions, h)
        for i in np.flatnonzero(flags).tolist():
            txn, offset = int(h["txn"][i]), int(h["base_offset"][i])
            if flags[i] & records.CONTROL and txn == 0:
                continue  # an epoch marker (replication): no transaction's
            if flags[i] & records.CONTROL:
                value = u8[int(value_at[i])]
                self.on_marker(txn, offset, value == records.COMMIT_MARKER[0])
            else:
                self.on_batch(txn, offset)

    def truncated(self, end: int, earliest: int, hw: Optional[int]) -> "PartitionTxns":
        """A fresh state for a log cut at ``end``, to be filled by ``scan`` from ``earliest``: it keeps the
        highest number and the aborted transactions a scan cannot find again (first batch below
        ``earliest``, gone with retention, marker below ``end``)."""
        fresh = PartitionTxns(hw)
        fresh.max_txn = self.max_txn
        fresh._aborted = [a for a in self._all_aborted() if a[1] < earliest and a[2] < end]
        fresh._aborted_arr = np.array(fresh._aborted, records.ABORTED_DTYPE)
        return fresh

    def _all_aborted(self) -> list:
        """The aborted transactions as if there were no cap (settled aborts included)."""
        return self._aborted + [(txn, first, marker) for marker, txn, first, commit in self.settled
                                if not commit and first < marker]

    # -- the snapshot file ----------------------------------------------------------------------------
    def load(self, directory: Path) -> Optional[int]:
        """Read the snapshot; returns the offset from which the log must be scanned (None: no snapshot)."""
        path = Path(directory) / SNAPSHOT
        if not path.exists():
            return None
        raw = path.read_bytes()
        try:
            crc, body = int(raw[:8], 16), raw[9:]
            if records.crc(body) != crc:
                raise ValueError("checksum mismatch")
            m = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptLogError(f"{path}: unreadable ({e}); it is rebuilt when it is deleted only if no "
                                  f"transaction was ever written to this partition", path, 0) from None
        self.ongoing = {int(t): int(o) for t, o in m["ongoing"]}
        self.settled = []
        self._first = min(self.ongoing.values()) if self.ongoing else None
        self._aborted = [tuple(int(x) for x in a) for a in m["aborted"]]
        self._aborted_arr = np.array(self._aborted, records.ABORTED_DTYPE)
        self.max_txn = int(m["max_txn"])
        return int(m["offset"])

    def save(self, directory: Path, offset: int, earliest: int) -> None:
        """Write the state as of ``offset`` (everything below it is taken in), forgetting aborted
        transactions wholly below ``earliest`` (retention removed them). Atomic and fsynced. The file holds
        the state without a cap (markers settle at once): the HW is the server's, set again after an open."""
        self._aborted = [a for a in self._aborted if a[2] > earliest]
        self._aborted_arr = np.array(self._aborted, records.ABORTED_DTYPE)
        body = json.dumps({"offset": offset, "max_txn": self.max_txn,
                           "ongoing": sorted(self.ongoing.items()),
                           "aborted": [list(a) for a in self._all_aborted()]}).encode()
        replace_file(Path(directory) / SNAPSHOT, b"%08x\n" % records.crc(body) + body)


def has_markers(u8: np.ndarray, positions: np.ndarray) -> bool:
    """Is any of the batches at ``positions`` of ``u8`` a transaction's marker (vectorised)?"""
    if not len(positions):
        return False
    h = records.headers_at(u8, positions)
    return bool((((h["attributes"] & records.CONTROL) != 0) & (h["txn"] != 0)).any())
