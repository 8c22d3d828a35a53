"""The transaction journal's file (Kafka's TransactionLog): its records, appending, recovery, compaction,
and the memory tail a master serves its replicas from. What the records mean is the state machine's
(``transactions.py``); this module only keeps them.

A record is ``u32 payload length | u32 CRC-32C of (type, payload) | u8 type | payload`` (``journal_frames``),
the payload a small JSON object with a ``seq`` (+1 per record). On open a torn tail is cut; damage followed
by valid records refuses to open; a failed write is cut back, so the file stays as it was and the broker
keeps serving. docs/transactions.md gives the layout.

Locking: none of its own. Its owner, ``TransactionManager``, calls every method holding its ``_lock`` (the
lock order is written in ``transactions.py``).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from metaq_broker.errors import CorruptLogError
from metaq_broker.store.durable import append_or_cut_back, replace_file
from metaq_broker.store.journal_frames import RECORD, bad_record, frame, split, valid_record_after

log = logging.getLogger(__name__)

JOURNAL = "transactions.log"
PREPARE, COMMIT, ROLLBACK, DONE, FINISHED = 1, 2, 3, 4, 5
KINDS = range(PREPARE, FINISHED + 1)
COMPACT_BYTES = 16 << 20  # rewritten with only what is still needed beyond this size
TAIL_BYTES = 8 << 20  # recent records kept in memory for replicas; one further behind gets a snapshot


def parse(frames: bytes) -> list:
    """The records of a stream from another broker as (seq, type, payload dict, frame); ValueError on a bad
    one (a stream has no torn tail)."""
    out = []
    for kind, payload, record in split(frames, KINDS):
        m = json.loads(payload)
        out.append((m["seq"], kind, m, record))
    return out


def encode(records: list) -> bytes:
    """Frames of ``(type, payload dict)`` records, as ``append`` writes them (each payload with its seq)."""
    return b"".join(frame(kind, json.dumps(m).encode()) for kind, m in records)


class TransactionJournal:
    """``<directory>/transactions.log``: ``recover`` it once, then ``append``; ``seq`` is the last record's."""

    def __init__(self, directory: Path, on_written: Optional[Callable[[], None]] = None):
        self.path = Path(directory) / JOURNAL
        self.seq = 0  # of the last record written, copied or recovered; 0 for none
        self._on_written = on_written  # wakes replica fetches waiting for news
        self._fd = -1
        self._size = 0
        self._tail: list = []  # frames of the last records (seq _tail_first on), at most about TAIL_BYTES
        self._tail_first, self._tail_bytes = 1, 0

    @property
    def size(self) -> int:
        return self._size

    def recover(self) -> list:
        """Read the file (none: empty) and open it for appending. Returns its records as (type, payload
        dict); one without a seq (a journal of a metaq without them) gets the next. A torn tail is cut
        (and fsynced); damage followed by a valid record raises CorruptLogError. The memory tail holds
        what is written from here on."""
        data = self.path.read_bytes() if self.path.exists() else b""
        out, pos, end = [], 0, len(data)
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
            m.setdefault("seq", self.seq + 1)
            self.seq = max(self.seq, m["seq"])  # a compacted journal's FINISHED has the highest
            out.append((kind, m))
            pos += RECORD.size + length
        self._open(end)
        self._tail, self._tail_first, self._tail_bytes = [], self.seq + 1, 0
        return out

    def append(self, kind: int, payload: dict, fsync: bool = False) -> int:
        """Append one record with the next seq (set in ``payload``) and return the seq. If the write or
        its fsync fails, the file is cut back to where it was and the error raised."""
        payload["seq"] = self.seq + 1
        record = frame(kind, json.dumps(payload).encode())
        append_or_cut_back(self._fd, self.path, [record], self._size, fsync)
        self._added(record, self.seq + 1)
        if self._on_written is not None:
            self._on_written()
        return self.seq

    def copy(self, record: bytes, seq: int) -> None:
        """Append a master's record byte for byte (a follower's), not fsynced: ``sync`` once after a run."""
        append_or_cut_back(self._fd, self.path, [record], self._size)
        self._added(record, max(self.seq, seq))

    def sync(self) -> None:
        os.fsync(self._fd)

    def rewrite(self, blob: bytes, seq: Optional[int] = None) -> None:
        """Replace the file with ``blob`` (temporary file, fsync, rename: a crash leaves one or the other).
        Without ``seq`` a compaction: seqs are kept, so the memory tail and replicas' positions stay valid.
        With ``seq`` another journal whose last record is ``seq`` (a follower's snapshot): the tail
        restarts after it."""
        replace_file(self.path, blob)
        self._open(len(blob))
        if seq is not None:
            self.restart(seq)

    def restart(self, seq: int) -> None:
        """Go on from ``seq`` with an empty memory tail: a replica asking for a record before it gets a
        snapshot."""
        self.seq = seq
        self._tail, self._tail_first, self._tail_bytes = [], seq + 1, 0

    def records_since(self, seq: int, max_bytes: int = 1 << 20) -> Optional[tuple]:
        """(first_seq, last_seq, frames) of the records after ``seq`` held in memory (at least one, then up
        to ``max_bytes``); (seq + 1, seq, b"") when there are none; None when ``seq`` is -1, older than the
        memory tail or ahead of this journal: a snapshot is needed instead."""
        if seq == self.seq and seq >= 0:
            return seq + 1, seq, b""
        if seq < 0 or seq > self.seq or seq + 1 < self._tail_first:
            return None
        out, size = [], 0
        for f in self._tail[seq + 1 - self._tail_first:]:
            if out and size + len(f) > max_bytes:
                break
            out.append(f)
            size += len(f)
        return seq + 1, seq + len(out), b"".join(out)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _open(self, size: int) -> None:
        """(Re)open the file for appending at ``size``, cutting (and fsyncing) anything past it: the one
        place the descriptor changes."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        self._size = size

    def _added(self, record: bytes, seq: int) -> None:
        self._size += len(record)
        self.seq = seq
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
